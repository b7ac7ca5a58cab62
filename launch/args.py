"""Arguments shared by the commands."""
from __future__ import annotations


def add_recipe_args(parser) -> None:
    parser.add_argument("-c", "--config", help="YAML recipe (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.hidden_size=512")
