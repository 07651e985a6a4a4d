"""Training drafts offline: the distillation corpus (``corpus``), the student and its resumable
loop (``distill``), the unrolled hidden-state-reuse head loss (``hsr_train``), and the zoo's
recipes, export and evaluation (``zoo``).

Training imports serving code (the draft model classes in ``replicas/drafts/``, model loading in
``replicas/model_store.py``), never the reverse: ``replicas/`` and ``router/`` serve what an
export wrote and must not import this package. The CLI (``specserve zoo ...``) imports it lazily.
"""
