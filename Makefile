# Quick start: `make demo` (the main job on the embedded demo model) and `make test`.
# Both set themselves up first (.ci/bootstrap.sh): virtual environment, packages, extension.
VENV ?= .venv
OUT ?= out/demo
PYTEST_ARGS ?=

.PHONY: setup demo test test-quick bench results results-pareto results-pareto-segmentation results-demo
setup:
	bash .ci/bootstrap.sh

demo: setup
	$(VENV)/bin/pullback demo --overwrite --out $(OUT)

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# The quick loop while developing: everything but the tests marked slow in python_tests/conftest.py.
test-quick: setup
	$(VENV)/bin/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/python benchmarks/bench_ops.py

# Regenerate the generated pages of docs/results/ with the reduced settings a 2-core machine affords.
results: setup
	$(VENV)/bin/python benchmarks/bench_prune.py --threads 2 --results-page
	$(VENV)/bin/python benchmarks/bench_metric.py --quick --threads 2 --results-page
	$(VENV)/bin/python benchmarks/bench_diagnose.py --quick --threads 2 --results-page

# Regenerate docs/results/demo-run.{json,md} from a full demo run (a checkout without local changes).
results-demo: setup
	$(VENV)/bin/pullback demo --overwrite --out out/demo --results-page

# Regenerate the matched-cost photo pages docs/results/pareto-{cls,depth}-photos with the current
# defaults of `pullback evaluate --pareto` (7 interleaved timing rounds, FLOPs of the task's own
# forward) and every method, importance_tome and DTEM included; a page needs a clean checkout. The
# importance heads and DTEM's embeddings they use are trained first, each step skipped when its output exists. Hours on a 2-core machine;
# the depth page times batch 16 rather than 64 (its targets are FLOP ratios; a quarter of the time).
PARETO_PHOTOS = $(VENV)/bin/pullback evaluate --model demo --images builtin:photos --pareto --num-images 110 --seeds 1 --threads 1 --overwrite
PARETO_CLS_METHODS ?= importance,importance_tome,importance_cluster,tome,pitome,mctf,tofu,atc,dtem,evit,asap,random
PARETO_DEPTH_METHODS ?= importance,importance_tome,importance_cluster,tome,pitome,mctf,tofu,atc,dtem,evit,expedite,asap,random
# The small head docs/importance_tome_findings.md chose (38k parameters, 1.2% of the backbone's FLOPs: the size `pullback train head` gives the demo by default).
TRAIN_HEAD = $(VENV)/bin/pullback train head --model demo --targets randnla --steps 400 --mlp-hidden 64 --hidden 64 --heads 2
# A head fine-tuned through importance_tome's relaxed merging from its distilled weights
# (docs/importance_tome_findings.md §5c: the CLS page's head is the block-0 head fine-tuned).
TRAIN_FINETUNE = $(VENV)/bin/pullback train finetune --model demo --steps 280 --batch-size 16 --lr 3e-4 --warmup 20

# DTEM's per-block embeddings, trained on the same scenes as the heads with the same steps and batch
# (a step here is a relaxed forward and backward through the frozen model: ~1.5 s on 2 cores).
TRAIN_DTEM = $(VENV)/bin/pullback train dtem --model demo --steps 400 --batch-size 16

runs/dtem_cls/results.json: | setup
	$(TRAIN_DTEM) --task cls --num-images 96 --out runs/dtem_cls

runs/dtem_depth/results.json: | setup
	$(TRAIN_DTEM) --task depth --num-images 64 --out runs/dtem_depth

runs/head_cls/results.json: | setup
	$(TRAIN_HEAD) --layer 1 --task cls --num-images 96 --out runs/head_cls

runs/head_cls_l0/results.json: | setup
	$(TRAIN_HEAD) --layer 0 --task cls --num-images 96 --out runs/head_cls_l0

runs/head_cls_l0_ft/results.json: runs/head_cls_l0/results.json
	$(TRAIN_FINETUNE) --task cls --init-head runs/head_cls_l0 --num-images 96 --out runs/head_cls_l0_ft

runs/head_depth/results.json: | setup
	$(TRAIN_HEAD) --layer 1 --task depth --num-images 64 --out runs/head_depth

results-pareto: setup runs/head_cls_l0_ft/results.json runs/head_depth/results.json runs/dtem_cls/results.json runs/dtem_depth/results.json
	$(PARETO_PHOTOS) --task cls --layers 1 --head runs/head_cls_l0_ft --trained dtem=runs/dtem_cls --methods $(PARETO_CLS_METHODS) --ratios 0.1,0.2,0.3,0.4,0.5,0.6,0.7 \
		--sweep importance_cluster:head=trained,none --sweep importance_cluster:taper=1,0.7 --results-page pareto-cls-photos \
		--out out/pareto_cls_photos
	$(PARETO_PHOTOS) --task depth --layers 2 --head runs/head_depth --trained dtem=runs/dtem_depth --methods $(PARETO_DEPTH_METHODS) --ratios 0.1,0.2,0.3,0.5,0.7 \
		--sweep importance_tome:head=trained,none --sweep importance_cluster:head=trained,none --sweep importance_cluster:taper=1,0.7 \
		--time-batches 1,16 --results-page pareto-depth-photos --out out/pareto_depth_photos

# The segmentation photo page docs/results/pareto-segmentation-photos: the depth page's recipe on the demo's
# shipped segmentation head (primary error: per-pixel KL ×100 of the class distributions), its importance head
# trained on the segmentation logits as the depth one is on the depth map; DTEM trains for cls and depth only.
PARETO_SEGMENTATION_METHODS ?= importance,importance_tome,importance_cluster,tome,pitome,mctf,tofu,atc,algm,expedite,evit,asap,random
runs/head_seg/results.json: | setup
	$(TRAIN_HEAD) --layer 1 --task segmentation --num-images 64 --out runs/head_seg

results-pareto-segmentation: setup runs/head_seg/results.json
	$(PARETO_PHOTOS) --task segmentation --layers 2 --head runs/head_seg --methods $(PARETO_SEGMENTATION_METHODS) --ratios 0.1,0.2,0.3,0.5,0.7 \
		--sweep importance_tome:head=trained,none --sweep importance_cluster:head=trained,none --time-batches 1,16 \
		--results-page pareto-segmentation-photos --out out/pareto_segmentation_photos
