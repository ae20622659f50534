"""Wire protocol (`messages`), socket set-up (`sockets`) and weight bucketing (`weights`)."""
