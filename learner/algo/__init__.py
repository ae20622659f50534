"""The RL algorithm: batches, advantages, the loss, the critic and the trainer that steps them."""
