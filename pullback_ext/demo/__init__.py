"""``pullback demo``, the application: every stage of the library run on the embedded demo model
(:mod:`pullback_ext.embedded`) and its held-out scenes, plus the script that trained that model
(``python -m pullback_ext.demo.train``). Nothing in the library imports this package."""
