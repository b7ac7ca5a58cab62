"""Trainer-side log-probs of Samples: the recompute that IcePop compares with the engine's.

The model math is ``orthon.pretrain.logprobs.sequence_log_probs``, the same function the engine's
"rescore" mode calls; this module only reads prompt + response out of ``orthon.rl.sample.Sample``.
"""
from __future__ import annotations

from orthon.pretrain.logprobs import ResponseLogProbs, sequence_log_probs
from orthon.pretrain.model import GLMForCausalLM


def sample_log_probs(model: GLMForCausalLM, samples, with_entropy: bool = False,
                     with_logits: bool = False) -> ResponseLogProbs:
    """``sequence_log_probs`` of ``orthon.rl.sample.Sample`` objects (tokens, response_length)."""
    return sequence_log_probs(model, [s.tokens for s in samples], [s.response_length for s in samples], with_entropy,
                              with_logits=with_logits)
