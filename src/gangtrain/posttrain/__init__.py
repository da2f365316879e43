"""The post-training assembly: one run's shared parts built once over the model's family
spec (`assembly`), and objectives by name (`objective`): sft, finetune, preference, grpo, or
a user's own by import path. The recipes (`recipes.sft`, ...) are thin modules over it:

    from gangtrain.posttrain import objective_named, recipe_cli
    recipe_cli(objective_named("sft"), PRESETS, argv, prog="python -m recipes.sft")
"""

from gangtrain.posttrain.assembly import Assembly, assemble, recipe_cli
from gangtrain.posttrain.objective import OBJECTIVES, Objective, Parts, objective_named

__all__ = ["OBJECTIVES", "Assembly", "Objective", "Parts", "assemble", "objective_named",
           "recipe_cli"]
