"""kvxferd: moves LLM KV-cache blocks between context and generation servers."""

__version__ = "0.1.0"

# Bumped whenever a peer or engine message changes incompatibly.
# 2: fencing. An engine must know `blocks_held` and the `released` message, and a context
# daemon must answer an Abort asked again on a new connection only once the write through
# the old one is quiescent: a version-1 peer on either side would silently break that.
PROTOCOL_VERSION = 2
