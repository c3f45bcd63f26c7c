"""The loader across epochs: where it stands (epoch numbers, the position a
state names), the job's ranks, resume from any rank's state or another world
size, and the statistics it keeps."""
