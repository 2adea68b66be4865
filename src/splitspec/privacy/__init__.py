"""Privacy is measured, not claimed: token-recovery audit and edge weight divergence.

* :mod:`~splitspec.privacy.corpus` - held-out documents split by document into attacker-train/test;
* :mod:`~splitspec.privacy.activations` - what the cloud sees at each split depth (both directions);
* :mod:`~splitspec.privacy.attackers` - baselines, white-box and learned token-recovery attackers;
* :mod:`~splitspec.privacy.stats` - Wilson intervals, exact McNemar, document-clustered bootstrap;
* :mod:`~splitspec.privacy.audit` / :mod:`~splitspec.privacy.report` - the audit and its report;
* :mod:`~splitspec.privacy.outcomes` - per-token audit outcomes (ranks per series), written and read back;
* :mod:`~splitspec.privacy.diverge` - LoRA fine-tuning of the edge layers away from stock;
* :mod:`~splitspec.privacy.weights` - stock-vs-private edge weight check and fingerprint;
* :mod:`~splitspec.privacy.record` - the divergence record a diverged checkpoint carries;
* :mod:`~splitspec.privacy.cli` - ``splitspec audit`` and ``splitspec diverge``.
"""
