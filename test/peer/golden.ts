// Bytes the previous release (hand-written encoders, each tested equal to protobuf-es) wrote for
// fixed values: the encoders now in place must write the same, so peers of either version and
// the Python connector (same .proto, protoc's Python code) read each other. The sealed forms use
// the key 32 x 0x07.
export const GOLDEN = {
  xferDone: "0a08702d656e67696e65100b181620055a120a057265712d311001180220808080012803",
  xferDoneSealed:
    "0a240a08702d656e67696e65100b181620055a120a057265712d31100118022080808001280312207d52ee8dfd77322481e53976fe208c5e1708117f47a5c16b0f3135799e427d7c",
  readDone: "0a08702d656e67696e65100b18162005620f0a057265712d321080201a03746f6b",
  readDoneSealed:
    "0a210a08702d656e67696e65100b18162005620f0a057265712d321080201a03746f6b1220c7753a7e2af3cd9d104eb8ab5be4af81cdc50a16e25058cbb204e38e80081aac",
  readAck: "0a08702d656e67696e65100b181620056a090a057265712d331001",
  readAckSealed:
    "0a1b0a08702d656e67696e65100b181620056a090a057265712d33100112203eb91250ce7fce9ba0685ed466413879fe60350cf8f1411386235731455b81b2",
  heartbeat: "0a08702d656e67696e65100b1816200572060a01610a0162",
  heartbeatSealed:
    "0a180a08702d656e67696e65100b1816200572060a01610a01621220aa4a7997106d0404a62b9a943ff2df5ac1e402eaebe95071b1a154bb6e73cad7",
  /** SidecarToEngine { kv_ready { transfer_id: "req-4" } }. */
  kvReady: "12070a057265712d34",
  /** WatchEventsResponse { event: seq 9, KV_READY, 1700000000000 ms, "req-5", "p-engine", DECODE, 2 MiB, PUSH }. */
  event: "0a25080910011880d095ffbc3122057265712d352a08702d656e67696e65300240808080014801",
  /**
   * EngineToSidecar { prefill_done { "req-6", blocks [3, 1, 300], 40 tokens, token "tk" } } as the
   * Python connector's generated code (kvxfer_vllm._gen) writes it.
   */
  prefillDoneFromPython: "12130a057265712d3612040301ac0218282202746b",
} as const;
