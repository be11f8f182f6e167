"""kvxferd: moves LLM KV-cache blocks between context and generation servers."""

__version__ = "0.1.0"

# Bumped whenever a peer or engine message changes incompatibly. One number for both
# channels: peers compare it in Hello/Challenge, engines in EngineHello (and PoolHandoff).
#
# History (what each version added; fields added later with defaults kept the number,
# since a build without them decodes the message and ignores the field):
# 1: the first daemon (e69db62). Engine API: hello, register/deregister_pool, recv, send,
#    cancel, release, query, reply, outcome. Peer channel: the HMAC handshake (Hello,
#    Challenge, Auth, Info, Ready, Refused), PoolsUpdate, RequestData/Result/Abort/AbortAck,
#    CancelRequest/CancelAnswer, Ping/Pong. Grown within 1: beam_width and the bounce
#    buffer's offers (9fc596a); PoolsUpdate.agent_metadata (358ba0a); staged rounds,
#    Result.first_block/end_block and RoundAck (328c582); Info.transport_address for the
#    two-sided backends (bec78de); tp_rank/tp_size and Recv.peers for head-split/merge
#    (5327461); the memfd pool handoff (abc97ed); Info.process and
#    RequestData.expires_unix_ms (074dd6b).
# 2: fencing (e859cdb, d472d2f, d2966ab). An engine must know `blocks_held` and the
#    `released` message, and a context daemon must answer an Abort asked again on a new
#    connection only once the write through the old one is quiescent: a version-1 peer on
#    either side would silently break that. Also Refused.quiescent and Info.wall_ms (the
#    clock offset behind RequestData.expires_unix_ms). Grown within 2:
#    RequestData.block_start and Recv.block_start (b55e29c, 83d0b78; a build without them
#    fails such a receive with block_mismatch, it never writes the wrong blocks),
#    Send.peer (8d0a767), StartTls for mutual TLS (3ee48a8; sent only by a daemon with
#    TLS configured, which a daemon without TLS cannot pair with anyway); GPU pools (issue
#    15): RegisterPool.memory/device_uuid/ipc_handle/ipc_offset, PoolHandoff.kind,
#    PoolInfo.memory/device/writable and Info.bounce_memory/bounce_device, whose defaults
#    describe host memory, so old peers and engines decode and mean what they meant (an
#    old daemon refuses a device RegisterPool by its exactly-one rule, a "cuda_vmm" fd by
#    its seal check; a vram daemon pairs only with vram daemons through the fingerprint).
PROTOCOL_VERSION = 2
