"""SpecPilot: lossless speculative decoding that tunes itself."""

__version__ = "0.1.0"
