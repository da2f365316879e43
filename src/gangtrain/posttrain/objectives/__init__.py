"""The objectives that ship (`gangtrain.posttrain.objective.OBJECTIVES` names them)."""
