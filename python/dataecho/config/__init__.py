"""The configuration: ``EchoLoader``'s arguments validated once, DataLoader's
keywords with DataLoader's meaning, and the echo setting.
"""

from __future__ import annotations



