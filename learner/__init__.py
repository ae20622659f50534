"""The learner: trainer, lease owner, trajectory receiver and weight publisher."""
