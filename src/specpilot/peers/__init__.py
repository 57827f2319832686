"""Peers: other engines run on the same prompts for comparison (``specpilot bench --peers``).

A peer generates greedy tokens for one prompt; the benchmark times it and token forcing compares its
output with ours. Each peer lives in its own module and imports its engine lazily, so the package
works without the optional dependencies.
"""

from __future__ import annotations

from specpilot.peers.hf import (
    PEER_NAMES,
    HFAssisted,
    HFGreedy,
    HFPromptLookup,
    Peer,
    build_hf_model,
    hf_model_from_dir,
    make_hf_peers,
)
from specpilot.peers.llamacpp import (
    LLAMACPP_PEER_NAMES,
    LlamaCppConfig,
    LlamaCppGreedy,
    LlamaCppLookup,
    PeerUnavailable,
    make_llamacpp_peers,
)

__all__ = [
    "LLAMACPP_PEER_NAMES",
    "PEER_NAMES",
    "HFAssisted",
    "HFGreedy",
    "HFPromptLookup",
    "LlamaCppConfig",
    "LlamaCppGreedy",
    "LlamaCppLookup",
    "Peer",
    "PeerUnavailable",
    "build_hf_model",
    "hf_model_from_dir",
    "make_hf_peers",
    "make_llamacpp_peers",
]
