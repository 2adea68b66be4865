"""Measurement tools: the RTT/overhead probe and the benchmark harness.

* :mod:`splitspec.bench.probe` -- separate link RTT from the fixed per-step overhead f(k) of a live
  deployment and derive break-even acceptance, projected tok/s and cost.
* :mod:`splitspec.bench.harness` -- run a scenario (model, split, RTTs, modes, prompt sets) over
  emulated WAN links beside local-only baselines; write JSON, markdown and plots.
* :mod:`splitspec.bench.cli` -- the ``splitspec probe`` and ``splitspec bench`` subcommands.
"""
