"""Draft sources, one a module: ``base`` (the interface and its declared capabilities), ``none``,
``ngram`` (prompt lookup), ``model`` (a draft model with its own KV cache), ``int8`` and ``layers``
(self-drafts made from the target), and ``registry`` (the ``--draft`` names, ``make_draft``)."""
