#include "backend/routes/PostSteps.hpp"

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include "backend/WorkHSDP.hpp"
#include "backend/routes/Route.hpp"

namespace hsdp {

namespace {

// The device the op's tensors live on (CPU when it has none, as a barrier).
c10::Device
deviceOf(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& keepAlive) {
  for (const auto* list : {&outputs, &keepAlive}) {
    for (const auto& t : *list) {
      if (t.defined()) {
        return t.device();
      }
    }
  }
  return c10::Device(c10::kCPU);
}

// Orders the current stream after `w`'s result without a host wait.
void waitOnCurrentStream(c10d::Work& w) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  try {
    future = w.getFuture();
  } catch (const c10::Error&) {
    w.wait(); // a Work without a future: its own wait is all there is
    return;
  }
  future->wait();
  if (!future->devices().empty() && future->storages().empty()) {
    // A device future whose value holds no storage recorded no event
    // (ivalue::Future::markCompleted records one per device of the value's
    // storages), so its wait ordered nothing: the Work's own synchronize()
    // does (WorkNCCL's: the current stream waits for its end event).
    w.synchronize();
  }
}

// Orders the current stream after the inner Works' results, without a host
// wait on CUDA (on a model's host stream the current stream is its thread).
void orderAfter(const std::vector<c10::intrusive_ptr<c10d::Work>>& ops, c10d::Work* blockEnd) {
  for (const auto& w : ops) {
    // Through the Work's device-aware future, not wait(): WorkNCCL::wait()
    // also hands back the tensors NCCL holds for the allocator, whose blocks
    // the caller's stream (which has not waited) could then reuse while
    // NCCL still runs. Failures surface through the returned Work.
    waitOnCurrentStream(*w);
  }
  if (blockEnd) {
    // Its future carries no event: synchronize() makes the current stream
    // wait for NCCL's end-of-block event. The tensors it hands back to the
    // allocator are kept alive by the returned Work, recorded on this stream.
    blockEnd->synchronize();
  }
}

} // namespace

std::vector<InnerWorks::WorkPtr> InnerWorks::all() const {
  auto works = ops;
  if (blockEnd) {
    works.push_back(blockEnd);
  }
  works.insert(works.end(), companions.begin(), companions.end());
  return works;
}

bool HostWorkers::handsBackInnerWork(c10d::OpType type) const {
  // Point-to-point Works complete independently of each other: waiting for
  // them one after another on a queue would make a receive's wait depend on
  // an earlier send's, so they stay the inner backend's own.
  return !fixedCompletionPool_ || isPointToPoint(type);
}

HostWorkers::WorkPtr HostWorkers::workAfter(
    int rank,
    c10d::OpType type,
    InnerWorks inner,
    std::vector<at::Tensor> outputs,
    std::function<void()> post,
    std::vector<at::Tensor> /*keepAlive: on the host the inner Works and `post` hold theirs*/) {
  OpQueue* queue;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!queue_) {
      queue_ = std::make_unique<OpQueue>();
    }
    queue = queue_.get();
  }
  return WorkHSDP::onQueue(
      *queue, rank, type, std::move(outputs), [works = inner.all(), post = std::move(post)] {
        // Blocking here is this thread's purpose: the inner ops were all
        // issued already, so each completes without anything further from
        // this process.
        for (const auto& w : works) {
          w->wait();
        }
        if (post) {
          post();
        }
      });
}

StreamOrdered::StreamOrdered(std::shared_ptr<PostStepStreams> streams)
    : streams_(std::move(streams)) {
  TORCH_CHECK(streams_, "hsdp: a stream-ordered route needs its side streams");
}

StreamOrdered::WorkPtr StreamOrdered::workAfter(
    int rank,
    c10d::OpType type,
    InnerWorks inner,
    std::vector<at::Tensor> outputs,
    std::function<void()> post,
    std::vector<at::Tensor> keepAlive) {
  const auto device = deviceOf(outputs, keepAlive);
  if (!streams_->serves(device)) {
    return host_.workAfter(
        rank, type, std::move(inner), std::move(outputs), std::move(post), std::move(keepAlive));
  }
  const bool hasPost = post != nullptr;
  auto run = streams_->run(
      device,
      [ops = inner.ops, end = inner.blockEnd, post = std::move(post)] {
        orderAfter(ops, end.get());
        if (post) {
          post();
        }
      },
      outputs,
      std::move(keepAlive));
  auto work = c10::make_intrusive<WorkOnStream>(
      rank, type, std::move(run), inner.all(), std::move(outputs));
  // A post-step captured in a CUDA graph runs at each replay, in the graph's
  // own order: later eager ops have nothing of it to wait for.
  if (hasPost && !work->mark()->captured()) {
    std::lock_guard<std::mutex> lock(mutex_);
    lastPostStep_ = work->mark();
    hasPostStep_.store(true, std::memory_order_release);
  }
  return work;
}

void StreamOrdered::beforeIssue() {
  if (!hasPostStep_.load(std::memory_order_acquire)) {
    return;
  }
  std::shared_ptr<const PostStepMark> last;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    last = lastPostStep_;
  }
  if (!last) {
    return;
  }
  // Under CUDA graph capture an event query is not allowed (in torch's
  // default, global capture mode it invalidates the capture), nor a wait on
  // an event recorded outside it; torch.cuda.graph synchronizes the device
  // before it captures, so the captured op needs no wait. The post-step is
  // kept for the eager ops after the capture (a bare capture_begin does not
  // synchronize).
  if (last->capturingNow()) {
    return;
  }
  if (last->done()) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (lastPostStep_ == last) {
      lastPostStep_.reset();
      hasPostStep_.store(false, std::memory_order_release);
    }
    return;
  }
  last->orderCurrentStreamAfter();
}

} // namespace hsdp
