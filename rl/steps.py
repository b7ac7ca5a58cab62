"""Post-training's step plug-ins for the one Trainer over batches of samples (token ids with a
response and its loss mask): ``SampleStep``, the micro-batching and data parallelism they share, and
``PolicyStep``, the IcePop policy loss over scored samples (SFT's is orthon.rl.sft.SFTStep).

A batch is the whole update's samples, on every rank. Only tokens whose ``loss_mask`` is 1 are
trained: a masked token (a tool observation, say) gets no gradient and does not count in the
normaliser. The normaliser (trained tokens, or trained sequences) is the whole batch's, so
micro-batching and data parallelism leave the gradient unchanged.

Micro-batches and their ranks follow ``rl.dp_schedule`` (orthon.rl.dp_schedule), a micro-batch holding
at most ``train.micro_batch_size`` samples. A rank left without samples (fewer samples than ranks) runs
one at weight 0, so that DDP's gradient all-reduce still meets every rank.
With ``kl_coef`` > 0 the policy loss adds the per-token KL to a frozen reference model, whose log-probs of
the step's samples are taken first, a forward a micro-batch.
"""
from __future__ import annotations

import torch

from orthon.core import distributed
from orthon.pretrain.steps import TrainStep
from orthon.rl.config import DPScheduleConfig
from orthon.rl.dp_schedule import padded_cost, schedule_from_config
from orthon.rl.logprobs import sample_log_probs
from orthon.rl.loss import aggregate_loss, icepop_token_loss, opd_kl_penalty_advantages, opd_sampled_advantages

LOSS_METRICS = ("masked_fraction", "logp_abs_diff", "clip_fraction", "entropy", "kl")  # per trained token
METRICS = (*LOSS_METRICS, "opd_reverse_kl")


def response_tensors(samples, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rollout log-probs, loss mask), each (B, width) fp32, zero past each response."""
    rollout = torch.zeros(len(samples), width)
    mask = torch.zeros(len(samples), width)
    for b, s in enumerate(samples):
        n = s.response_length
        rollout[b, :n] = s.rollout_log_probs
        mask[b, :n] = torch.as_tensor(s.loss_mask[:n], dtype=torch.float32)
    return rollout, mask


class SampleStep(TrainStep):
    """Micro-batches of this rank's share of a batch of samples, and the global normaliser (see the
    module docstring). Subclasses give ``sample`` (a batch item's sample), ``normaliser`` and
    ``micro_loss``."""

    update_moe_bias = False  # post-training leaves the routers' balancing biases as pretraining left them
    takes_empty_micro_batches = True  # ``loss`` runs one sample at weight 0

    @property
    def runs_expert_parallel(self) -> bool:
        """Every rank runs as many micro-batches (a rank without samples one at weight 0), so each MoE
        layer's expert exchange meets every rank, when the schedule gives each rank equally many."""
        return self.dp.equal_micro_batches

    def __init__(self, dp_schedule=None):
        self.dp = dp_schedule or DPScheduleConfig()
        self.denominator, self.world, self.rank, self.copies = 1.0, 1, 0, 1
        self.plan, self.trainable, self.schedule_metrics = None, [], {}

    @staticmethod
    def sample(item):
        """The sample (tokens, response_length, loss_mask) of a batch item."""
        return item

    def distinct(self, sums: dict) -> dict:
        """The step's metric sums (added over every rank) with each sample counted once."""
        return {key: value / self.copies for key, value in sums.items()} if self.copies > 1 else sums

    def normaliser(self, samples) -> float:
        """What the summed loss is divided by: the trained tokens."""
        return sum(sum(s.loss_mask) for s in samples)

    def begin(self, trainer, batch) -> None:
        self.trainable = [item for item in batch if self.sample(item).response_length > 0]
        samples = [self.sample(item) for item in self.trainable]
        self.denominator = max(float(self.normaliser(samples)), 1.0)
        # The data-parallel replicas split the samples; the ranks of one replica (megatron's tensor-parallel
        # group) run the same ones, so their metric sums count each sample that many times.
        self.world, self.rank = trainer.data_world, trainer.data_rank
        self.copies = trainer.world // trainer.data_world
        lengths = [len(s.tokens) for s in samples]
        self.plan = schedule_from_config(lengths, self.world, self.dp, max_samples=trainer.cfg.micro_batch_size)
        padded = float(padded_cost(self.plan.micro_batches, lengths).sum())
        self.schedule_metrics = {"dp_balance": self.plan.balance,
                                 "padding_fraction": 1.0 - sum(lengths) / padded if padded else 0.0,
                                 "oversized_samples": sum(n > self.dp.micro_batch_tokens for n in lengths)}

    def micro_batches(self, batch, size: int, device) -> list:
        """This rank's micro-batches of ``begin``'s plan (``size``, train.micro_batch_size, is in it)."""
        return [[self.trainable[i] for i in part] for part in self.plan.samples_for_rank(self.rank)]

    def sequence_lengths(self, micro) -> list[int]:
        return [len(self.sample(item).tokens) - 1 for item in micro]  # inputs: every token but the last

    def input_shape(self, micro) -> tuple[int, int]:
        samples = [self.sample(item) for item in micro or self.trainable[:1]]  # as ``loss`` runs it
        return len(samples), max(len(s.tokens) for s in samples)  # sample_log_probs' right-padded batch

    def loss(self, model, micro):
        if not micro:  # a rank without samples this step: one at weight 0 (see the module docstring)
            objective, _ = self.micro_loss(model, self.trainable[:1])
            return objective * 0.0, {}
        return self.micro_loss(model, micro)

    def micro_loss(self, model, micro) -> tuple[torch.Tensor, dict[str, float]]:
        """(this micro-batch's share of the update's objective, summed metrics)."""
        raise NotImplementedError


class PolicyStep(SampleStep):
    def __init__(self, loss_cfg, reference: torch.nn.Module | None = None, opd=None, teachers=None,
                 dp_schedule=None):
        """``opd``: the OPDConfig when distilling; form 2 reads each sample's teacher_log_probs, form 1
        needs ``teachers`` ({set name: frozen model}) for the teachers' full distributions.
        ``dp_schedule``: the DPScheduleConfig (default: its defaults). ``reference`` may be set after
        construction (RLTrainer places it as the policy, once its Trainer exists)."""
        super().__init__(dp_schedule)
        self.cfg, self.reference, self.opd, self.teachers = loss_cfg, reference, opd, teachers or {}
        self.mismatch_max = 0.0
        self.reference_log_probs: dict[int, torch.Tensor] = {}  # this step's, by id of the sample (``begin``)
        # Set by RLTrainer for an update whose samples were generated on the weights it starts from:
        # their rollout log-probs become this forward's (the rescore, without another forward).
        self.rescore_in_forward = False

    @staticmethod
    def sample(item):
        return item[0]  # (Sample, advantage)

    def normaliser(self, samples) -> float:
        if self.cfg.aggregation == "token":
            return super().normaliser(samples)
        return sum(1 for s in samples if any(s.loss_mask))

    def begin(self, trainer, batch) -> None:
        if self.cfg.kl_coef > 0 and self.reference is None:
            raise ValueError("PolicyStep: kl_coef > 0 needs a reference model")
        if self.opd is not None and self.opd.form == "kl_penalty" and not self.teachers:
            raise ValueError("PolicyStep: OPD form kl_penalty needs the teacher models")
        super().begin(trainer, batch)
        self.mismatch_max = 0.0
        self.reference_log_probs = self._reference_log_probs(trainer) if self.cfg.kl_coef > 0 else {}

    def _reference_log_probs(self, trainer) -> dict[int, torch.Tensor]:
        """The frozen reference's log-probs of this rank's samples, {id(sample): row}: its forward of each of
        this rank's micro-batches (a rank without samples one, as ``loss`` runs), before the update. Apart
        from the policy's forward, so a reference placed as the policy (FSDP2's shards, megatron's pipeline,
        whose forward outside a step runs its own schedule on every stage) meets every rank as its forward
        needs."""
        out = {}
        with torch.no_grad(), trainer.autocast():
            for micro in self.micro_batches(None, 0, None):
                samples = [self.sample(item) for item in micro or self.trainable[:1]]
                for sample, row in zip(samples, sample_log_probs(self.reference, samples).log_probs):
                    out[id(sample)] = row
        return out

    def micro_loss(self, model, micro):
        samples = [s for s, _ in micro]
        advantages = torch.tensor([float(a) for _, a in micro])
        form1 = self.opd is not None and self.opd.form == "kl_penalty"
        out = sample_log_probs(model, samples, with_entropy=True, with_logits=form1)
        if self.rescore_in_forward:
            for b, sample in enumerate(samples):
                sample.rollout_log_probs = out.log_probs[b, : sample.response_length].detach().float().cpu().clone()
        device = out.log_probs.device
        rollout, mask = (t.to(device) for t in response_tensors(samples, out.mask.shape[1]))
        advantages, opd_sums = self._opd_advantages(samples, advantages.to(device), out, mask)
        reference = torch.stack([self.reference_log_probs[id(s)] for s in samples]) if self.cfg.kl_coef > 0 else None
        token_loss, metrics = icepop_token_loss(
            out.log_probs, rollout, advantages.to(device), mask, beta=self.cfg.icepop_beta, eps_low=self.cfg.eps_low,
            eps_high=self.cfg.eps_high, keep_weight=self.cfg.keep_weight, kl_coef=self.cfg.kl_coef,
            logp_ref=reference, entropy=out.entropy)
        # DDP averages gradients over the data-parallel ranks: multiply back by their number (the normaliser is global).
        objective = aggregate_loss(token_loss, mask, self.cfg.aggregation, denominator=self.denominator) * self.world
        n = float(mask.sum())
        sums = {key: float(metrics[key]) * n for key in LOSS_METRICS if key in metrics}
        sums["trained_tokens"] = n
        sums.update(opd_sums)
        self.mismatch_max = max(self.mismatch_max, float(((out.log_probs.detach() - rollout).abs() * mask).max()))
        return objective, sums

    def _opd_advantages(self, samples, advantages, out, mask):
        """Per-token OPD advantages ([B, T]) and the summed reverse-KL estimate log pi_S - log pi_T over
        trained tokens; the outcome advantages unchanged when not distilling."""
        if self.opd is None:
            return advantages, {}
        student = out.log_probs.detach()
        teacher = torch.zeros_like(student)
        for b, s in enumerate(samples):
            if s.teacher_log_probs is None:
                raise ValueError(f"sample {s.instance_id!r}: OPD needs teacher_log_probs (rl.rollout: orthon.rl.distill.opd_rollout)")
            teacher[b, : s.response_length] = s.teacher_log_probs.to(teacher.device)
        sums = {"opd_reverse_kl": float(((student - teacher) * mask).sum())}
        if self.opd.form == "sampled":
            return opd_sampled_advantages(teacher, student, mask, coef=self.opd.coef, advantages=advantages), sums
        teacher_logits = torch.zeros_like(out.logits)
        with torch.no_grad():
            for name in {s.metadata.get("teacher") for s in samples}:
                rows = [b for b, s in enumerate(samples) if s.metadata.get("teacher") == name]
                logits = sample_log_probs(self.teachers[name], [samples[b] for b in rows], with_logits=True).logits
                teacher_logits[rows, : logits.shape[1]] = logits.to(teacher_logits.dtype)
        return opd_kl_penalty_advantages(advantages, teacher_logits, out.logits.detach(), mask, coef=self.opd.coef,
                                         direction=self.opd.kl_direction), sums

    def end(self, trainer, sums):
        sums = self.distinct(sums)
        n = max(sums.get("trained_tokens", 0.0), 1.0)
        metrics = {key: sums[key] / n for key in METRICS if key in sums}
        mismatch = float(distributed.all_reduce_max(torch.tensor(self.mismatch_max, device=trainer.device)))
        metrics.update(trained_tokens=sums.get("trained_tokens", 0.0), logp_mismatch_max=mismatch,
                       **self.schedule_metrics)
        return metrics
