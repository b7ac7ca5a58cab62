"""The multi-turn, tool-using rollout plug-in (``rl.rollout: orthon.rl.multi_turn.tool_rollout``).

Each of the G samples of a prompt is a session: the prompt as a user turn in the chat format
(orthon.rl.chat), then up to ``max_turns`` assistant turns. A turn that ends with a tool call is
parsed, run by its tool (the sandbox for ``python``), and the tool's output appended as an observation
turn (loss mask 0), truncated to ``max_observation_tokens`` (counted); a malformed call gets the parse
error as its observation; a tool that raises or runs past ``tool_timeout_s`` gets that as its
observation. A turn without a call ends the session and its content is scored by the reward. All
requests of a session carry its routing key (its session id), so a router sends them to one engine.
Sessions are tracked token-exact by orthon.rl.trajectory; a fork (the re-rendered context differs from
the ids generated) makes an extra training branch, carried in the sample's ``metadata["forks"]``.

``rl.rollout_args`` (all optional): tools ({name: dotted path of fn(code) -> str}; default: python in
the sandbox), max_turns (4), max_observation_tokens (256), max_context (the engine's), tool_timeout_s
(30), system (a system message), clear_thinking (false: re-render the conversation each turn with
earlier thinking dropped), render_each_turn (false: build each context from ids; true: re-render the
whole conversation as text-based frameworks do, which forks on any re-tokenisation drift).
"""
from __future__ import annotations

import dataclasses
from collections import Counter

from orthon.core.plugins import resolve
from orthon.rl.chat import ROLE_TOKENS, Message, ToolCall, parse_tool_call, render, render_message, split_assistant
from orthon.rl.rewards.registry import call_with_timeout
from orthon.rl.rollout import RolloutContext, count_prompt_tokens, score
from orthon.rl.sample import Sample, SampleStatus
from orthon.rl.trajectory import Trajectory

DEFAULT_TOOLS = {"python": "orthon.rl.tools.python_tool"}


@dataclasses.dataclass
class _Session:
    prompt: object
    number: int  # j x G + k: the request's place in the batch (its seeds follow from it)
    trajectory: Trajectory
    messages: list[Message]
    done: bool = False
    status: SampleStatus = SampleStatus.COMPLETED
    answer: str = ""
    versions: list[int] = dataclasses.field(default_factory=list)
    tool_calls: int = 0
    truncated_observations: int = 0


def _run_tool(fn, code: str, timeout_s: float) -> str:
    """The tool's output as text; an exception or a tool past its time limit is reported, not raised."""
    out = call_with_timeout(lambda: str(fn(code)), timeout_s)
    if "error" in out:  # the model's code broke the tool: the model is told so
        return f"tool error: {type(out['error']).__name__}: {out['error']}"
    return out.get("value", f"tool error: no result after {timeout_s:g}s")


def tool_rollout(ctx: RolloutContext, prompts) -> list[Sample]:
    opts = dict(ctx.options or {})
    tools = {name: resolve(path, f"rl.rollout_args.tools.{name}") for name, path in opts.get("tools", DEFAULT_TOOLS).items()}
    max_turns, max_obs = int(opts.get("max_turns", 4)), int(opts.get("max_observation_tokens", 256))
    max_context = int(opts.get("max_context", 0)) or None
    tool_timeout = float(opts.get("tool_timeout_s", 30.0))
    clear_thinking, rerender = bool(opts.get("clear_thinking", False)), bool(opts.get("render_each_turn", False))
    system = opts.get("system")
    tok = ctx.tokenizer
    stops = tuple(i for i in (tok.token_to_id(ROLE_TOKENS["observation"]), tok.token_to_id(ROLE_TOKENS["user"]),
                              tok.eos_id) if i is not None)
    counters = Counter()

    sessions = []
    for j, prompt in enumerate(prompts):
        messages = ([Message("system", system)] if system else []) + [Message("user", prompt.text)]
        for k in range(ctx.group_size):
            ids = tok.encode(render(messages))
            sessions.append(_Session(prompt, j * ctx.group_size + k, Trajectory(ids, f"{prompt.instance_id}/{k}"), list(messages)))
    base_seed = ctx.sampling.seed
    for turn in range(max_turns):
        active = [s for s in sessions if not s.done]
        if not active:
            break
        contexts = []
        for s in active:
            if turn == 0:
                contexts.append(s.trajectory.ids())
            elif rerender or clear_thinking:
                contexts.append(s.trajectory.continue_with(tok.encode(render(s.messages, clear_thinking))))
            else:  # token in, token out: the path's ids, then the new turns' ids
                head = tok.encode(render_message(s.messages[-1]) + f"{ROLE_TOKENS['assistant']}\n")
                contexts.append(s.trajectory.continue_with(s.trajectory.ids() + head))
        params = []
        for s in active:
            seed = None if base_seed is None else (base_seed + s.number) * max_turns + turn
            params.append(dataclasses.replace(ctx.sampling, seed=seed, stop_token_ids=stops))
        keep = [i for i, c in enumerate(contexts) if max_context is None or len(c) + 1 < max_context]
        for i in set(range(len(active))) - set(keep):
            active[i].done, active[i].status = True, SampleStatus.TRUNCATED
            counters["context_full"] += 1
        active = [active[i] for i in keep]
        if not active:
            break
        results = ctx.engine.generate([contexts[i] for i in keep], [params[i] for i in keep],
                                      routing_keys=[s.trajectory.session_id for s in active])
        count_prompt_tokens(ctx, results)
        for s, result in zip(active, results):
            if not result.ok:
                s.done, s.status = True, SampleStatus.FAILED
                continue
            s.trajectory.add_generated(result.tokens, result.log_probs)
            s.versions.append(result.weight_version)
            reply = split_assistant(tok.decode(result.tokens))
            s.messages.append(reply)
            call = parse_tool_call(reply.content, tools)
            if call is None:
                s.done, s.answer = True, reply.content
                s.status = SampleStatus.COMPLETED if result.finish_reason == "stop" else SampleStatus.TRUNCATED
                continue
            if isinstance(call, ToolCall):
                s.tool_calls += 1
                output = _run_tool(tools[call.tool], call.code, tool_timeout)
            else:
                counters["parse_errors"] += 1
                output = call.message
            ids = tok.encode(output)
            if len(ids) > max_obs:
                output = tok.decode(ids[:max_obs]) + "\n[output truncated]"
                s.truncated_observations += 1
                counters["observations_truncated"] += 1
            s.messages.append(Message("observation", output))
    for s in sessions:
        if not s.done:
            s.status = SampleStatus.TRUNCATED  # still calling tools at the turn limit
            counters["turn_limit"] += 1
    return _to_samples(ctx, sessions, counters)


def _to_samples(ctx, sessions, counters) -> list[Sample]:
    rewards = score([(s.answer, s.prompt.label) for s in sessions], ctx)
    samples = []
    for s, reward in zip(sessions, rewards):
        meta = {"label": s.prompt.label, "tool_calls": s.tool_calls, "turns": len(s.versions),
                "observations_truncated": s.truncated_observations, "forks": []}
        if s.status is SampleStatus.FAILED or not s.versions:
            samples.append(Sample(s.prompt.instance_id, s.trajectory.root.ids, session_id=s.trajectory.session_id,
                                  status=SampleStatus.FAILED, reward=0.0, metadata=meta))
            continue
        owned: set[int] = set()
        branches = [s.trajectory.branch_sample(leaf, owned) for leaf in s.trajectory.branches()]
        *forks, main = branches
        meta["forks"] = [{**f, "rollout_log_probs": f["rollout_log_probs"].tolist()} for f in forks if sum(f["loss_mask"])]
        samples.append(Sample(s.prompt.instance_id, main["tokens"], response_length=main["response_length"],
                              loss_mask=main["loss_mask"], rollout_log_probs=main["rollout_log_probs"],
                              reward=float(reward),
                              session_id=s.trajectory.session_id, policy_version=min(s.versions),
                              status=s.status, metadata=meta))
    if ctx.stats is not None:
        ctx.stats.update(counters)
    return samples
