"""Shared fixtures and the ``slow`` marking of the test suite.

Fixtures (factories where a test may need several variants; every model has random weights
unless it is the shipped demo model):

- ``seeded``: torch, numpy and ``random`` seeded with 0 for the test, their states put back
  afterwards so that no test depends on another's draws (``seeded_rngs(seed)`` is the same as a
  context manager).
- ``tiny_vit(...)``: a timm ``VisionTransformer`` on 32-px images, patch 8 (16 patch tokens).
- ``timm_weights``: ``(model name, safetensors path)`` of a random ``vit_tiny_patch16_224`` at
  32 px, for command-line tests that take ``--model timm:NAME --weights FILE``.
- ``demo_model``: the shipped embedded demo model (trained weights), frozen; shared by the whole
  session, so tests must not modify it (patch a ``random_demo_model()`` instead).
- ``random_demo_model(seed=0)``: a fresh demo-architecture model with random weights, frozen.
- ``heldout_scenes(n, seed=0)``: held-out rendered scenes of the demo (cached per arguments).
- ``image_folder(count=3, size=(40, 48), seed=0)``: a folder of random RGB PNGs (cached).
- ``out_dir``: a not-yet-existing output folder inside the test's ``tmp_path``.

Slow tests: ``pytest -m "not slow"`` is the quick loop (about 2 minutes on 2 busy cores); CI runs
everything. The tests listed in ``SLOW`` below (measured with ``--durations``) get the marker here,
so no test file needs editing; an entry names a module (``test_x.py``), a test function (all its
parameters: ``test_x.py::test_f``) or one parametrization (``test_x.py::test_f[p]``).
"""

from __future__ import annotations

import contextlib
import functools
import random
import warnings

import numpy as np
import pytest
import torch

# Tests that took 2 s or more (setup + call + teardown) in one run of the whole suite with
# --durations=0 on a 2-core machine shared with other jobs (load average 6-10, so every time is
# inflated against an idle machine); the rest took 118 s there. Plus the demo pruning stage's test
# (test_demo_stage_uses_the_trained_head_at_its_layer), which failed early in that run, and the VAE
# training test, which took 64 s in the check run of `-m "not slow"` (0.6 s in the full run).
SLOW: tuple[str, ...] = (
    "test_dtem.py::test_the_patched_forward_compiles_whole",
    "test_dtem.py::test_two_process_ddp_matches_single_process",
    "test_dtem.py::test_train_dtem_command_reports_the_deployed_merge_on_the_eval_images",
    "test_tofu.py::test_the_patched_forward_compiles_whole_and_reads_nothing_on_the_host",
    "test_atc.py::test_fullgraph_compile_equals_eager_and_the_eager_forward_reads_nothing_on_the_host",
    "test_mctf.py::test_the_patched_forward_compiles_whole_and_reads_no_tensor_value_on_the_host",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[merge]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[three_stages]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[tome]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[evit]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[pitome]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[hf_dinov2_merge]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[hf_dinov2_registers_prune_llf]",
    "test_compile_patched.py::test_inductor_compiles_the_patched_merge",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[merge_folded]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[prune_llf_two_calls]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[hf_dinov2_tome]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[hf_dinov2_evit]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[random]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[tome_score]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[evit_score]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[cls_sim]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[asap_score]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[asap]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[expedite]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[vit_merge]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[vit_prune_llf]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[clip_merge]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[clip_prune_llf]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[siglip_merge]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[siglip_prune_llf]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[dinov3_merge]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[dinov3_prune_llf]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[eva_merge]",
    "test_compile_patched.py::test_fullgraph_compile_equals_eager[eva_prune_llf]",
    "test_compile_patched.py::test_the_patch_adds_no_graph_break_to_dpt",
    "test_cuda_build.py::test_checks_raise_from_validation_and_kernels[cpu]",
    "test_demo_command.py::test_failing_stage_is_recorded_and_exit_code_is_1",
    "test_demo_command.py::test_quick_demo_end_to_end",
    "test_demo_probes.py::test_probe_reproduces_model_outputs",
    "test_demo_probes.py::test_depth_probe_pooling_and_single_image",
    "test_demo_probes.py::test_forward_mode_jvp_matches_finite_differences",
    "test_demo_weights.py::test_model_interface",
    "test_demo_weights.py::test_heldout_quality_reaches_90_percent_of_the_model_card",
    "test_demo_weights.py::test_missing_weights_file_names_it",
    "test_demo_weights.py::test_corrupt_weights_file_names_it",
    "test_demo_weights.py::test_weights_of_another_model_are_rejected",
    "test_demo_weights.py::test_non_finite_weights_are_rejected",
    "test_demo_weights.py::test_cli_reports_bad_weights_with_exit_code_2",
    "test_diagnose.py::test_timm_probe_against_dense_oracle[0-cls-randomized]",
    "test_diagnose.py::test_timm_probe_against_dense_oracle[1-tokens-randomized]",
    "test_diagnose.py::test_timm_probe_against_dense_oracle[1-tokens-dense]",
    "test_diagnose.py::test_hutchinson_kappa_within_three_standard_errors",
    "test_diagnose.py::test_dpt_depth_probe_against_dense_oracle",
    "test_diagnose.py::test_auto_svd_is_dense_only_when_the_trace_is_exact",
    "test_diagnose.py::test_reproducible_and_independent_of_batching",
    "test_diagnose_cli.py::test_timm_cli_writes_json_and_plots_matching_the_library",
    "test_diagnose_cli.py::test_linear_decoder",
    "test_diagnose_cli.py::test_hf_dpt_cli",
    "test_diagnose_cli.py::test_demo_cli",
    "test_diagnose_cli.py::test_bad_input_one_line_error[layer]",
    "test_diagnose_cli.py::test_bad_input_one_line_error[rank]",
    "test_diagnose_cli.py::test_bad_input_one_line_error[garbage_weights]",
    "test_diagnose_cli.py::test_torchrun_two_processes_equals_single_process",
    "test_diagnose_io.py::test_model_preprocessing_sizes",
    "test_diagnose_io.py::test_plots_are_written_atomically",
    "test_fixtures.py::test_slow_list_marks_modules_tests_and_parametrizations",
    "test_docs_snippets.py::test_snippet_runs_as_written",  # every Python block of the docs: about a minute
    "test_head.py::test_head_learns_imp_star_of_a_cls_probe",
    "test_head_schedule.py::test_trains_one_head_per_stage_on_the_block_before_it",
    "test_head_schedule.py::test_evaluate_runs_the_trained_schedule_at_its_layers",
    "test_head_schedule.py::test_resume_skips_finished_stages_and_continues_the_rest",
    "test_linalg.py::test_rsvd_agrees_with_scipy_svds_on_a_jacobian_operator",
    "test_linalg.py::test_jacobian_operator_matches_dense_jacobian_for_any_chunk_size",
    "test_linalg.py::test_slq_effective_rank_matches_spectral_entropy",
    "test_metric_cli.py::test_train_head_then_eval_head",
    "test_metric_cli.py::test_train_spn_exact_and_refuses_to_overwrite",
    "test_metric_cli.py::test_train_vae_then_spn_at_its_latent",
    "test_metric_cli.py::test_bad_arguments_exit_2_with_a_one_line_message[argv1---images]",
    "test_metric_cli.py::test_bad_arguments_exit_2_with_a_one_line_message[argv2-layer]",
    "test_metric_demo_stage.py",
    "test_metric_targets.py::test_exact_and_randnla_targets_match_the_dense_svd",
    "test_metric_targets.py::test_sketches_are_reproducible_per_stream_id",
    "test_metric_training.py::test_killed_run_resumes_to_the_uninterrupted_result",
    "test_metric_training.py::test_weight_average_follows_the_trajectory_and_resumes_exactly",
    "test_metric_training.py::test_two_process_ddp_matches_single_process_on_the_global_batch",
    "test_tap_training.py::test_two_process_ddp_matches_single_process",
    "test_tap_training.py::test_training_leaves_the_frozen_backbone_bit_identical",
    "test_tap_pareto.py::test_each_checkpoint_gets_a_labelled_row_over_rho_and_its_unpruned_drop",
    "test_tap_training.py::test_train_tap_command_reports_on_the_eval_images",
    "test_metric_training.py::test_mixed_precision_trains_with_finite_losses[spn]",
    "test_metric_training.py::test_sigkill_while_writing_a_checkpoint_resumes_to_the_uninterrupted_result",
    "test_ops.py::test_paper_sized_cpu_operands_match_reference",
    "test_ops.py::test_gradcheck[cpu]",
    "test_ops.py::test_opcheck[cpu]",
    "test_ops_qr.py::test_qr_isa_variants_agree",
    "test_patch_hf_dinov2.py::test_zero_ratio_is_exact_and_unpatch_restores",
    "test_patch_hf_dinov2.py::test_depth_anything_prunes_through_its_dinov2_backbone",
    "test_patch_hf_dpt.py::test_zero_ratio_is_exact_and_unpatch_restores",
    "test_patch_hf_dpt.py::test_full_llf_matches_a_hand_written_reference_and_hidden_states_are_full",
    "test_patch_hf_dpt.py::test_masked_llf_leaves_kept_tokens_as_without_llf",
    "test_patch_timm.py::test_zero_ratio_reproduces_the_unpruned_model_exactly[norm-prune]",
    "test_patch_timm.py::test_zero_ratio_reproduces_the_unpruned_model_exactly[cls_sim-merge]",
    "test_patch_timm.py::test_zero_ratio_reproduces_the_unpruned_model_exactly[cls_sim-prune]",
    "test_patch_timm.py::test_zero_ratio_reproduces_the_unpruned_model_exactly[asap_score-merge]",
    "test_patch_timm.py::test_zero_ratio_reproduces_the_unpruned_model_exactly[asap_score-prune]",
    "test_patch_timm.py::test_zero_ratio_reproduces_the_unpruned_model_exactly[oracle-merge]",
    "test_patch_timm.py::test_zero_ratio_reproduces_the_unpruned_model_exactly[oracle-prune]",
    "test_patch_timm.py::test_masked_llf_leaves_kept_tokens_as_without_llf_and_updates_the_reinserted_ones",
    "test_patch_timm.py::test_llf_restores_token_order_and_frozen_features_in_intermediates",
    "test_patch_timm.py::test_batch_rows_are_independent",
    "test_patch_timm.py::test_unpatch_restores_the_model_and_keeps_its_state_dict",
    "test_patch_timm.py::test_torch_compile_runs_a_patched_model",
    "test_patch_timm.py::test_random_strategy_is_seeded",
    "test_patch_timm.py::test_pullback_matching_with_an_spn_differs_from_cosine_and_keeps_rows_independent",
    "test_probes.py::test_timm_probe_reproduces_forward_features_and_head[vit]",
    "test_probes.py::test_cls_row_last_block_matches_the_full_block",
    "test_probes.py::test_hf_depth_probe_reproduces_predicted_depth[0-dpt]",
    "test_probes.py::test_hf_depth_probe_reproduces_predicted_depth[0-depth_anything]",
    "test_probes.py::test_hf_depth_probe_reproduces_predicted_depth[2-dpt]",
    "test_probes.py::test_hf_multi_layer_probe_reads_only_the_decoder_inputs",
    "test_probes.py::test_hf_single_layer_jvp_matches_dense_and_depends_on_the_image_context",
    "test_probes_hf_dinov2.py::test_jvps_through_sdpa_attention_match_the_dense_jacobian",
    "test_probes_hf_dinov2.py::test_diagnose_train_and_evaluate_a_dinov2_folder",
    "test_probes_hf_dinov2.py::test_a_cropping_image_processor_sets_the_input_size",
    "test_probes_hf_families.py::test_eva_probe_reproduces_the_model_and_its_jvps_match_the_dense_jacobian[vit_small_patch16_rope_mixed_224-64]",
    "test_probes_hf_families.py::test_train_a_head_and_evaluate_on_a_folder[vit_cls]",
    "test_probes_hf_families.py::test_train_a_head_and_evaluate_on_a_folder[clip_projection]",
    "test_probes_hf_families.py::test_train_a_head_and_evaluate_on_a_folder[siglip]",
    "test_probes_hf_families.py::test_train_a_head_and_evaluate_on_a_folder[dinov3]",
    "test_probes_hf_families.py::test_train_a_head_and_evaluate_on_a_timm_eva",
    "test_prune_evaluate.py::test_demo_backbone_reduced_output_equals_the_model_at_zero_ratio",
    "test_prune_evaluate.py::test_depth_table_with_and_without_llf",
    "test_prune_evaluate.py::test_cost_counts_fewer_flops_when_pruning",
    "test_prune_evaluate.py::test_cli_end_to_end_on_a_timm_model",
    "test_prune_evaluate.py::test_cli_subspace_interventions_with_a_probe_file",
    "test_prune_evaluate.py::test_cli_end_to_end_on_hugging_face_dinov2_and_depth_anything",
    "test_prune_evaluate.py::test_demo_stage_uses_the_trained_head_at_its_layer",
    "test_scenes.py::test_shapes_and_ranges",
    "test_scenes.py::test_labels_are_balanced_and_name_the_largest_object",
    "test_spn_training.py::test_randnla_q1_reaches_the_exact_ceiling_and_random_init_does_not",
    "test_spn_training.py::test_energy_branch_learns_the_singular_values",
    "test_spn_training.py::test_learned_columns_pair_with_their_energies",
    "test_study.py::test_study_diagnose_equals_diagnose_at_each_layer",
    "test_study.py::test_study_subspace_equals_subprobe_at_each_layer",
    "test_study.py::test_study_criteria_equals_evaluate_at_each_layer",
    "test_study.py::test_study_diagnose_runs_on_a_hugging_face_folder",
    "test_study_torchrun.py",
    "test_vae.py::test_training_reduces_reconstruction_error",
)


def _slow_keys(item: pytest.Item) -> tuple[str, ...]:
    module = item.path.name
    function = getattr(item, "originalname", item.name)
    return module, f"{module}::{function}", f"{module}::{item.name}"


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow, used = set(SLOW), set()
    for item in items:
        hits = slow.intersection(_slow_keys(item))
        if hits:
            item.add_marker(pytest.mark.slow)
            used |= hits
    if any("::" in str(arg) for arg in config.args):
        return  # single tests were asked for: the other entries were not collected
    collected = {item.path.name for item in items}
    stale = sorted(e for e in slow - used if e.split("::")[0] in collected)
    if stale:
        warnings.warn(pytest.PytestWarning("conftest.SLOW names tests that no longer exist: " + ", ".join(stale)))


@contextlib.contextmanager
def seeded_rngs(seed: int = 0):
    """torch, numpy and ``random`` seeded with ``seed`` inside the block; their states put back after."""
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    try:
        yield seed
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])


@pytest.fixture
def seeded():
    with seeded_rngs(0) as seed:
        yield seed


@pytest.fixture
def tiny_vit():
    """Factory: ``tiny_vit(seed=0, dtype=torch.float64, depth=3, embed_dim=32, img_size=32, **kwargs)``
    -> a timm VisionTransformer in eval mode (patch 8, 2 heads; ``kwargs`` go to the constructor,
    e.g. ``num_classes=0``, ``reg_tokens=4``)."""
    from timm.models.vision_transformer import VisionTransformer

    def make(seed: int = 0, dtype: torch.dtype = torch.float64, depth: int = 3, embed_dim: int = 32, img_size: int = 32, **kwargs):
        torch.manual_seed(seed)
        kwargs = {"patch_size": 8, "num_heads": 2, **kwargs}
        return VisionTransformer(img_size=img_size, embed_dim=embed_dim, depth=depth, **kwargs).to(dtype).eval()

    return make


@pytest.fixture(scope="session")
def timm_weights(tmp_path_factory):
    import timm
    from safetensors.torch import save_file

    name = "vit_tiny_patch16_224"
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, img_size=32)
    path = tmp_path_factory.mktemp("weights") / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return name, path


@pytest.fixture(scope="session")
def demo_model():
    from pullback_ext.embedded import load

    return load()


@pytest.fixture
def random_demo_model():
    """Factory: ``random_demo_model(seed=0)`` -> DemoModel with random weights, eval, frozen."""
    from pullback_ext.embedded.model import DemoModel

    def make(seed: int = 0):
        torch.manual_seed(seed)
        return DemoModel().eval().requires_grad_(False)

    return make


@pytest.fixture(scope="session")
def heldout_scenes():
    """Factory: ``heldout_scenes(n, seed=0)`` -> ``pullback_ext.embedded.heldout(n, seed)`` (cached;
    treat the tensors as read-only)."""
    from pullback_ext.embedded import heldout

    return functools.lru_cache(maxsize=None)(heldout)


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory):
    """Factory: ``image_folder(count=3, size=(40, 48), seed=0)`` -> folder of ``img{i}.png``
    (uint8 RGB noise, height × width ``size``); one folder per distinct arguments."""
    from PIL import Image

    @functools.lru_cache(maxsize=None)
    def make(count: int = 3, size: tuple[int, int] = (40, 48), seed: int = 0):
        folder = tmp_path_factory.mktemp("images")
        rng = np.random.default_rng(seed)
        for i in range(count):
            Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        return folder

    return make


@pytest.fixture
def out_dir(tmp_path):
    return tmp_path / "out"
