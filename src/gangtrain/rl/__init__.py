"""Online RL services: generation (`generation`), reward functions (`rewards`), group
advantages (`advantages`), rollout records and replay (`rollouts`), the prompt-window data
reader (`windows`)."""
