"""WAN emulation and link modelling: the pure link model (:mod:`splitspec.netem.schedule`), the
delaying, jittering, rate-limiting TCP proxy that applies it (:mod:`splitspec.netem.emulator`) and
the throughput projection that separates round-trip time from fixed per-step overhead
(:mod:`splitspec.netem.projection`)."""
