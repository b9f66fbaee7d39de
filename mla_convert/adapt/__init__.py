"""Fine-tuning a converted checkpoint (``mla-convert adapt``).

``options`` (the job's options and the schedule derived from them), ``data`` (documents to packed
training rows and validation windows), ``objectives`` (trainable sets, losses, the hooks feeding them),
``workdir`` (the resumable ``.OUT.adapt/`` folder), ``report`` (OUT's report, card, plot) and ``train``
(:func:`~mla_convert.adapt.train.run_adapt`, the training job).
"""
