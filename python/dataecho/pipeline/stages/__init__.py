"""The stages of an epoch's chain, each behind the protocol of
dataecho.pipeline.stages.stage: the intake (examples into the echo buffer, or a
batch sampler's batches), batch echo, augment (in threads or worker processes),
the ranks' lockstep and the delivery (ordering, device copies)."""
