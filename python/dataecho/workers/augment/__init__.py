"""Who augments: ``augment`` run on the rows of a batch, the same in a thread of
the training process and in augment worker processes, which read the batches
where the echo buffer staged them."""
