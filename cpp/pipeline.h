// Pipeline schedules over the "pp" axis (AxoNN, AxoNN; Megatron-LM, Megatron's 1F1B).
// The engine owns the control flow and the messages; the caller's callbacks do the
// compute of one microbatch on this stage:
//   forward(mb, input)  -> pointer to this stage's output (input: null on stage 0)
//   backward(mb, grad)  -> pointer to the gradient of this stage's input (grad: null on
//                          the last stage, which starts the backward from its loss;
//                          the return value is ignored on stage 0)
// A message is the `payload_bytes` alone (stage_message_bytes), sent in place from the bytes a
// callback returned: the caller keeps them alive until PipelineConfig::sent reports the send
// complete, and the engine copies nothing. A callback's input is the engine's receive buffer,
// which may take another message as soon as the callback returns (two buffers per source: the
// next message's receive is posted before this one is computed on, into the other): the callback
// copies what it keeps, the one copy a message makes. No message carries a header: a
// neighbour's messages of one kind come in microbatch order in every schedule, so who sent a
// message and how many came from there before say what it is.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "communicator.h"

namespace gridweave {

// [kind, microbatch] (two int64 words, host memory): what the announced strategy says on its
// control channel before each message, and what a stage's first member tells the others it took.
constexpr std::size_t kStageHeaderBytes = 16;

// The bytes of one pipeline message on the wire: the payload, or one word where it is empty
// (cSub's idle sub-grids carry empty shards; the message still drives the schedule).
constexpr std::size_t stage_message_bytes(std::size_t payload_bytes) { return payload_bytes > 0 ? payload_bytes : 8; }

using StageForward = std::function<const void*(int microbatch, const void* input)>;
using StageBackward = std::function<const void*(int microbatch, const void* grad)>;
// The interleaved schedule's callbacks also name the model chunk (0..chunks-1) of this stage.
using ChunkForward = std::function<const void*(int microbatch, int chunk, const void* input)>;
using ChunkBackward = std::function<const void*(int microbatch, int chunk, const void* grad)>;
// Called with what a callback returned once its message's send has completed: the engine reads
// those bytes no more (on a stream-ordered transport, the send's kernel has run).
using StageSent = std::function<void(const void* data)>;

enum class PipelineSchedule : int { MessageDriven = 0, OneFOneB = 1, Interleaved = 2 };

// How a stage waits for its neighbours' messages: one receive-from-any over both (needs
// Communicator::can_recv_any); one receive posted per neighbour, polled; or Announced: each
// message is announced on a host control channel that can receive from any peer, and the
// data receive is posted for exactly that message (what NCCL needs: it has no
// receive-from-any, and no receive is then ever posted ahead of its send). Auto picks
// receive-from-any where the transport can, else Announced when a control channel is given.
enum class ReceiveStrategy : int { Auto = 0, Any = 1, PerPeer = 2, Announced = 3 };

// The communicators a stage talks to its neighbours on. Under NCCL's rules (a communicator
// runs its ops in issue order; a send waits for its receive) an activation and a gradient that
// cross, or a receive posted ahead of its send, deadlock on one shared communicator. With one
// two-member communicator per neighbour and direction (Grid::link) each queue holds one kind
// of message from one sender, in the order it sends them, which NCCL matches in order
// (Megatron-Core groups each send with the receive it crosses instead; links also serve the
// message-driven schedule, whose next message is not known in advance). A null link falls
// back to the pp communicator itself (hosts that match by tag).
struct StageLinks {
  std::shared_ptr<Communicator> to_next, from_prev;  // activations
  std::shared_ptr<Communicator> to_prev, from_next;  // gradients
  // In a V (run_table, ChunkPlacement::V) the second chunk's activations travel back towards
  // stage 0 and its gradients forward: four more ends, each still one kind from one sender.
  std::shared_ptr<Communicator> act_to_prev, act_from_next;
  std::shared_ptr<Communicator> grad_to_next, grad_from_prev;
};

struct PipelineConfig {
  int stage = 0;
  int stages = 1;
  int microbatches = 1;
  int pipeline_limit = 1;  // microbatches in flight (AxoNN Algorithm 2)
  std::size_t payload_bytes = 0;
  ReceiveStrategy receive = ReceiveStrategy::Auto;
  // The CUDA stream the stage computes on (torch's current stream; null on the host): messages
  // are filled and read in its order, and a receive the schedule knows in advance (1F1B,
  // interleaved) only makes it wait, the host goes on.
  void* stream = nullptr;
  // Each sent message's bytes are released through it (null: they live until the schedule returns).
  StageSent sent;
};

// Per-run counters: messages received, and the seconds spent inside callbacks vs waiting.
// copies / copied_bytes: payload copies made for this stage's messages, the engine's (none: it
// sends the callbacks' bytes in place and hands them its receive buffers) plus what the caller
// adds for its callbacks (gw.pipeline: one per received message, into the tensor the stage
// computes on). posted_ahead: received messages whose receive was posted before a compute
// callback that ran to its end before the message was needed (so the transfer could overlap it).
struct PipelineStats {
  int forwards = 0, backwards = 0, messages = 0;
  int weights = 0;  // W steps run apart from their backward (run_table's split schedules)
  double compute_s = 0, wait_s = 0;
  std::int64_t copies = 0, copied_bytes = 0;
  int posted_ahead = 0;
};

// Algorithm 2: receives stay posted from both neighbours (one receive-from-any at a time,
// re-posted before the compute of the message it delivered); whichever message arrives
// first is processed; stage 0 keeps pipeline_limit microbatches in flight, injecting one
// each time a backward completes; the last stage turns each forward into a backward.
// stage_group: a host communicator over the other ranks of this stage (its tensor and
// sequence axes), whose forward and backward run collectives together: a stage between two
// others then takes its messages in the order its first member receives them (null or one
// member: each rank by its own arrivals).
PipelineStats run_message_driven(Communicator& pp, const PipelineConfig& cfg, const StageForward& forward,
                                 const StageBackward& backward, Communicator* control = nullptr,
                                 const StageLinks& links = {}, Communicator* stage_group = nullptr);

// Megatron's synchronous 1F1B with flush: warm-up forwards, one-forward-one-backward,
// cool-down backwards, each message to a known peer. What comes next on each link is known, so
// its receive is posted one message ahead (Megatron's overlapped p2p): before the compute of the
// message before it, into the other of the link's two buffers.
PipelineStats run_one_f_one_b(Communicator& pp, const PipelineConfig& cfg, const StageForward& forward,
                              const StageBackward& backward, const StageLinks& links = {});

// Megatron's interleaved 1F1B (Megatron-LM §2.2, Fig. 4): each stage holds `chunks` model chunks;
// a microbatch visits the virtual stages c * stages + s (c = 0..chunks-1), the last stage's
// chunk c feeding stage 0's chunk c + 1. Warm-up forwards, one-forward-one-backward, cool-down
// backwards, in Megatron's order; the bubble shrinks to (p - 1) / (chunks m). Needs m a
// multiple of the stages. Activations and gradients travel on separate links (tags where there
// are none), so with two stages (each the other's both neighbours) neither overtakes the other;
// receives are posted ahead as in 1F1B.
PipelineStats run_interleaved(Communicator& pp, const PipelineConfig& cfg, int chunks, const ChunkForward& forward,
                              const ChunkBackward& backward, const StageLinks& links = {});

// A schedule given as a table (gw.schedules): each stage's ops in the order it runs them. F runs a
// micro-batch's forward through one chunk, BW its whole backward, B the backward for the chunk's
// input alone (its input gradient is sent at once) and W the weight gradients B left (Qi et al.,
// "Zero Bubble Pipeline Parallelism", ICLR 2024: B on the critical path, W in the bubbles).
enum class StageOpKind : int { F = 0, B = 1, W = 2, BW = 3 };
struct StageOp {
  StageOpKind kind = StageOpKind::F;
  int chunk = 0;
  int microbatch = 0;
};
// Where a stage's chunks sit in the model: Loop, chunk c is virtual stage c * stages + stage
// (Megatron's interleaving); V, chunk 0 is virtual stage `stage` and chunk 1 is 2 stages - 1 -
// stage (ZB-V, DualPipeV), so the last stage hands chunk 0's output to its own chunk 1 and the
// loss is on stage 0.
enum class ChunkPlacement : int { Loop = 0, V = 1 };
// backward(mb, chunk, grad, input_only): input_only for B (the weights' part left for W)
using SplitBackward = std::function<const void*(int microbatch, int chunk, const void* grad, bool input_only)>;
using ChunkWeight = std::function<void(int microbatch, int chunk)>;
// Runs this stage's `ops`. Each link's messages are taken in the order the table uses them, which
// is the order their sender sends them (per chunk, micro-batches in order: gw.schedules.validate);
// receives are posted one ahead as in 1F1B. The V's hand-off on the last stage is local: chunk
// 0's output is chunk 1's input, and chunk 1's input gradient chunk 0's output gradient.
PipelineStats run_table(Communicator& pp, const PipelineConfig& cfg, int chunks, ChunkPlacement placement,
                        const std::vector<StageOp>& ops, const ChunkForward& forward, const SplitBackward& backward,
                        const ChunkWeight& weight, const StageLinks& links = {});

}  // namespace gridweave
