"""The model zoo: the one home of every tiny model the tests build.

Real Hugging Face models built from their config classes (no hub access, random weights) and a few hand-written
modules, grouped by what they are for:

* :mod:`zoo.families` -- :data:`~zoo.families.FAMILIES`, every common family at one size (2 blocks, hidden 64, 4
  heads, 2 KV heads where the family has grouped-query attention) with its example inputs, and
  :data:`~zoo.families.MORE` (BART, Qwen3-MoE) beside it;
* :mod:`zoo.matrix` -- issue 16's family matrix (no-argument, seeded builders an exported script can name as its
  ``factory``: ``tests.zoo.matrix:nanogpt``) and the shared tiny decoder config :data:`~zoo.matrix.DECODER`;
* :mod:`zoo.tp` -- the models of the two-rank tensor-parallel runs (``tests/multirank/tp_train.py``'s cases, hidden
  32, unseeded: the runner seeds);
* :mod:`zoo.pp` -- the models of the pipeline runs (``tests/multirank/pp_models.py``: a BERT classifier, GPT-2, T5,
  two hand-written stacks with skips and nesting, and one builder per family of the pipeline family runs);
* :mod:`zoo.scale` -- full-size configs (Llama 2 / Llama 3 70B) for the tests that plan, draw or check a real-scale
  model on the meta device.

``tests/`` is on ``sys.path`` for every test (pytest's ``pythonpath``) and for the scripts torchrun launches
(``tests/multirank/*.py`` put it there), so each imports ``zoo.<module>``. The zoo imports nothing from the other
test modules. Transformers' whole catalogue, shrunk generically from each config class, is
``tests/family_sweep.py``'s :func:`~family_sweep.build`.
"""
