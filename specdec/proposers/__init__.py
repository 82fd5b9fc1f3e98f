"""Proposers: where draft tokens come from. Each owns its state; the engine only calls the
`Proposer` protocol (begin / propose / accept / release)."""

from specdec.proposers.base import Proposal, Proposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer

__all__ = ["Proposal", "Proposer", "DraftModelProposer", "NgramProposer"]
