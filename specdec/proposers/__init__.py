"""Proposers: where draft tokens come from. Each owns its state; the engine only calls the
`Proposer` protocol (specdec.proposers.base)."""

from specdec.proposers.base import Proposal, Proposer, ProposerBase
from specdec.proposers.composite import CompositeProposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer

__all__ = ["Proposal", "Proposer", "ProposerBase", "CompositeProposer", "DraftModelProposer", "NgramProposer"]
