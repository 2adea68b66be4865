"""Tests of splitspec.netem: the WAN emulator, its CLI and the projection model."""
