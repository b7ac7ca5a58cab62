"""Arguments shared by the commands, and the checks every command that builds a model makes first."""
from __future__ import annotations

import dataclasses
import os

from orthon.core.errors import ConfigError, OrthonError


def add_recipe_args(parser) -> None:
    parser.add_argument("-c", "--config", help="YAML recipe (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.hidden_size=512")


def require_recipe(args, name: str) -> None:
    """A command that allocates and trains a model needs a recipe: without one the recipe's defaults are
    GLM-5 itself (744B parameters), which no laptop can hold."""
    if not args.config:
        raise OrthonError(f"no recipe given: add -c RECIPE, e.g. `orthon {name} -c configs/tiny.yaml` (the 8.6M-parameter "
                          f"model that trains on a laptop CPU); without -c the defaults are GLM-5 itself "
                          f"(configs/glm5.yaml, 744B parameters, a cluster's job)")


def machine_memory() -> tuple[int, str]:
    """(bytes, what) of the memory a model is trained in: one GPU's, or this machine's RAM."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.total_memory, f"GPU memory ({props.name})"
    from orthon.core.allocator import physical_memory

    return physical_memory(), "memory"


def check_recipe_fits(recipe, command: str = "train", world: int | None = None, frozen: int = 0) -> None:
    """check_model_fits for a recipe's model under its parallelism (the torch backend's, or megatron's), with
    ``frozen`` frozen copies placed as the policy (RL's KL reference, OPD's teachers).
    megatron's ``init: orthon`` draws the whole model in every process first: it must fit too."""
    megatron = recipe.megatron if recipe.backend == "megatron" else None
    check_model_fits(recipe.model, recipe.train, command, world, megatron=megatron, frozen=frozen)
    if megatron is not None and megatron.init == "orthon" and not recipe.train.init_from:
        check_weights_fit(recipe.model, f"{command} (megatron.init=orthon draws the whole model in every process "
                                        f"first)", advice="set megatron.init=megatron (each rank draws its part)")


def check_model_fits(model_config, train=None, command: str = "train", world: int | None = None,
                     megatron=None, frozen: int = 0) -> None:
    """Refuse, before anything is allocated, a model whose training state cannot fit: one rank's parameters
    (counted on the meta device; model_info.rank_parameters under ``train``'s parallelism, a TrainConfig;
    None: every rank holds the whole model) x 16 bytes against one GPU's memory or this machine's RAM
    (shared by the processes torchrun starts here), and 4 bytes more for each of ``frozen`` fp32 copies placed
    as the model. ``world``: the ranks (default: torchrun's WORLD_SIZE; Ray's trainer ranks are counted as
    all on this machine). ORTHON_NO_MEMORY_CHECK=1 skips the check."""
    if os.environ.get("ORTHON_NO_MEMORY_CHECK", "0") not in ("", "0"):
        return
    import torch

    from orthon.pretrain.model_info import BYTES_PER_PARAM, parameter_counts, rank_parameters

    counts = parameter_counts(model_config)
    n_params = sum(c["total"] for c in counts.values())
    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    share = rank_parameters(counts, world, train, megatron) * (BYTES_PER_PARAM + 4 * frozen)  # one rank's part
    need = share if torch.cuda.is_available() else share * local
    have, what = machine_memory()
    if have and need > have:
        raise ConfigError(
            f"model: {n_params / 1e9:,.2f}B parameters need about {need / 1e9:,.1f} GB to {command} "
            f"({BYTES_PER_PARAM} bytes each: fp32 weights, gradients, optimizer state"
            f"{f'; 4 more for each of {frozen} frozen copies placed as it' if frozen else ''}), more than this "
            f"machine's {have / 1e9:,.1f} GB of {what}; choose a smaller model in the recipe (model.hidden_size, "
            f"model.num_hidden_layers, model.n_routed_experts, ...; configs/tiny.yaml is 8.6M parameters), "
            f"or set ORTHON_NO_MEMORY_CHECK=1")


def check_weights_fit(model_config, command: str,
                      advice: str = "serve a model this size with SGLang (rl.cluster's engines)") -> None:
    """Refuse, before any tensor is read, a model that a command loads whole into this process's RAM
    (generation, the long-context evaluation: fp32, as ``load_weights`` builds it) when its weights alone
    exceed this machine's memory. ORTHON_NO_MEMORY_CHECK=1 skips the check."""
    if os.environ.get("ORTHON_NO_MEMORY_CHECK", "0") not in ("", "0"):
        return
    from orthon.core.allocator import physical_memory
    from orthon.pretrain.model_info import parameter_counts

    n_params = sum(c["total"] for c in parameter_counts(model_config).values())
    need, have = n_params * 4, physical_memory()
    if have and need > have:
        raise ConfigError(
            f"model: {n_params / 1e9:,.2f}B parameters need about {need / 1e9:,.1f} GB to {command} (fp32 "
            f"weights, the whole model in one process), more than this machine's {have / 1e9:,.1f} GB of "
            f"memory; {advice}, or set ORTHON_NO_MEMORY_CHECK=1")


def check_rl_fits(model_config, recipe, command: str) -> None:
    """RL and post-training: one trainer rank's training state (``check_model_fits``, over the Ray trainer
    ranks where the cluster runs), and the whole model in one process wherever a part needs it: the
    in-process engine, the tensors gathered on trainer rank 0 for the engines (the shared path; disk and
    distributed hand the ranks' shards over a part at a time, or by delta each rank's rows or parts), the KL
    reference and OPD teachers where the ranks do not shard the policy (those of its architecture are placed
    as the policy, megatron's too; a teacher of another, or beside megatron's policy, is loaded whole)."""
    cluster = recipe.rl.cluster
    whole = []
    if not cluster.enabled:
        whole.append("the in-process engine holds the whole model")
    elif cluster.gathers_whole:
        whole.append(f"weight_sync {cluster.weight_sync} gathers the whole model on trainer rank 0; disk or "
                     f"distributed hand it over a part at a time")
    from orthon.backends.megatron.model import sizes_of
    from orthon.pretrain.trainer import holds_shards, other_fields, weights_path
    from orthon.pretrain.weights import load_config

    world = (cluster.trainer_ranks if cluster.enabled else None) or int(os.environ.get("WORLD_SIZE", "1"))
    megatron = recipe.megatron if recipe.backend == "megatron" else None
    sharded = holds_shards(recipe.train, world) or (megatron is not None and sizes_of(megatron).splits_model)
    placed = 0  # frozen copies placed as the policy: each rank holds its share of each
    if recipe.rl.loss.kl_coef > 0:
        if sharded:
            placed += 1
        else:
            whole.append("the KL reference model is loaded whole")
    opd = recipe.rl.opd
    for teacher in opd.teachers if opd is not None and opd.form == "kl_penalty" else ():
        if other_fields(teacher.weights, model_config):  # another architecture: whole in every process
            check_weights_fit(load_config(weights_path(teacher.weights)),
                              f"{command} (the OPD teacher {teacher.name} is loaded whole)")
        elif not sharded or megatron is not None:  # beside megatron's policy orthon's model, whole
            whole.append(f"the OPD teacher {teacher.name} is loaded whole")
        else:
            placed += 1
    check_recipe_fits(dataclasses.replace(recipe, model=model_config), command,
                      cluster.trainer_ranks if cluster.enabled else None, frozen=placed)
    if whole:
        check_weights_fit(model_config, f"{command} ({'; '.join(whole)})")


def held_out(loss: float | None) -> str:
    """A done line's held-out part: a run without held-out stores says so instead of printing nan."""
    return "no held-out set (data.valid)" if loss is None else f"held-out loss {loss:.4f}"
