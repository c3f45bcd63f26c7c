"""The compiled buffer as dataecho's stages use it: named methods over
``_core.Buffer``, its configuration and page-heap sizing, and the policy that
decides which values it holds by reference.
"""

from __future__ import annotations



