"""splitspec: private and federated LLM inference over wide-area networks.

An edge machine keeps the tokenizer, embedding, first and last decoder layers, final norm and LM
head; an untrusted cloud machine runs the middle layers (the trunk). Only hidden states cross the
link. See README.md and docs/architecture.md for the picture.
"""

__version__ = "0.1.0"
