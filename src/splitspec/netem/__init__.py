"""WAN emulation and link modelling: a delaying, jittering, rate-limiting TCP proxy
(:mod:`splitspec.netem.emulator`) and the throughput projection model that separates round-trip
time from fixed per-step overhead (:mod:`splitspec.netem.projection`)."""
