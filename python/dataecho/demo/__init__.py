"""``python -m dataecho demo``: train a small model to a target accuracy with and
without data echoing, on real images read and decoded from PNG files, and show
how much sooner echoing gets there when input is the bottleneck."""
