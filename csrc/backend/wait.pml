/*
 * The wait contract of a Work hsdp completes on its own threads (OpQueue.cpp's
 * submit and worker loop, its rescuer; WorkHSDP.cpp's onQueue and waits), as a
 * model for spin. scripts/check_protocol.sh checks it beside the engine's:
 *   safety   - a wait() on a caller's thread returns only after the Work's
 *              future's callbacks ran; a task a step submits runs without
 *              the rescuer (which takes 20 ms to act) (assertions);
 *   liveness - no wait is left waiting for ever (no invalid end state), in
 *              every scenario below, for every interleaving of the threads.
 *
 * The contract. A queue runs its tasks one at a time, in issue order, on its
 * workers. After a task, its worker runs the task's completion step: it
 * completes the future (which runs the callbacks), then `released`. Waiting
 * for a Work ends with `released` on a caller's thread, but with the future
 * on one of the queue's threads (onCompletionThread: in a task or a step),
 * where a callback may wait for its own Work. From the moment a step submits
 * a task to its own queue until the step ends, idle workers take queued tasks
 * (one is made if none is idle); a task runnable but not started while steps
 * run is taken by an idle worker once the rescuer has seen it so (it looks
 * every 20 ms; here, at any moment the condition holds).
 *
 * Modelled: one queue, workers made as OpQueue makes them (one at the start),
 * a condition variable whose notify_one wakes one sleeper and notify_all
 * all, no spurious wake-ups (the stricter case for lost ones). The task is
 * the inner op, complete at once; the callback is attached before the task
 * can run. Scenarios, all explored in one run (init picks one):
 *   SELF    - op 0's callback waits for op 0's Work;
 *   NESTED  - op 0's callback issues op 1 and waits for it; op 1's callback
 *             issues op 2 and waits for it (nesting two deep);
 *   LATER   - op 0's callback waits for op 1, which the caller issues after
 *             op 0 (the rescuer's case);
 *   CROSS   - op 0's and op 1's callbacks each wait for the other's Work.
 * The caller then waits for each Work it issued. What the model leaves out:
 * deadlines (every real wait is bounded by the inner op's timeout, which the
 * model's ops never reach), the synchronous calls that run inline, the
 * queue's destruction.
 *
 * Each -D switch breaks one rule; the script checks that spin then finds the
 * failure:
 *   RELEASED_ON_WORKER - a wait on the queue's threads also ends with
 *                        `released` (SELF waits for itself);
 *   NO_ELASTIC         - a task a step submits gets no worker of its own
 *                        (NESTED waits for the rescuer);
 *   NO_RESCUE          - no rescuer (LATER's task waits behind the step that
 *                        waits for it);
 *   EARLY_RELEASE      - `released` before the callbacks (a caller's wait
 *                        returns before them: the assertion);
 *   NO_WAKE            - the caller's submit to an idle queue wakes no
 *                        worker (the worker sleeps through it).
 */

#define N_OPS 3
#define MAXW 4

mtype = { NONE, WAIT_SELF, WAIT_OP, ISSUE_WAIT };
mtype callback[N_OPS]; /* what op i's callback does */
byte arg[N_OPS];       /* the op it waits for or issues */
bool byCaller[N_OPS];  /* the caller issues it (else a callback does) */
bool servedWithoutRescue; /* the scenario's tasks need no rescuer */

/* The queue (OpQueue::State). */
byte tasks[N_OPS];
byte head, tail;
bool busy;
byte idle, inThen, waitingSteps;
bool rescue;
byte workers;
bool sleeping[MAXW];

/* Per op: its Work's future, `released`, and its callback having run. */
bool futureDone[N_OPS], released[N_OPS], callbackRan[N_OPS];

#define runnable (head != tail && !busy)
#define mayTake(hot) (runnable && (hot || inThen == 0 || waitingSteps > 0 || rescue))

inline wakeOne() {
  w = 0;
  do
  :: w < MAXW && sleeping[w] -> sleeping[w] = false; break
  :: w < MAXW && !sleeping[w] -> w++
  :: w >= MAXW -> break
  od
}

inline wakeAll() {
  w = 0;
  do
  :: w < MAXW -> sleeping[w] = false; w++
  :: else -> break
  od
}

inline addWorker() {
  if
  :: workers < MAXW -> idle++; run Worker(workers); workers++
  :: else -> skip
  fi
}

/* OpQueue::submit; `fromStep`: by a completion step of this queue, which
 * has issued to it before iff `issued`. */
inline submit(op, fromStep, issued) {
  atomic {
    tasks[tail] = op;
    tail++;
#ifndef NO_ELASTIC
    if
    :: fromStep ->
       if
       :: !issued -> issued = true; waitingSteps++
       :: else -> skip
       fi;
       if
       :: idle == 0 -> addWorker()
       :: else -> skip
       fi;
       wake = 2
    :: else ->
#endif
       if
#ifndef NO_WAKE
       :: !busy && inThen == 0 -> wake = 1
#endif
       :: else -> wake = 0
       fi
#ifndef NO_ELASTIC
    fi
#endif
  }
  /* notified after the unlock */
  atomic {
    if
    :: wake == 1 -> wakeOne()
    :: wake == 2 -> wakeAll()
    :: else -> skip
    fi
  }
}

/* Work::wait(): WorkHSDP::waitForTheEnd. */
inline waitFor(op, onQueueThread) {
#ifdef RELEASED_ON_WORKER
  released[op]
#else
  if
  :: onQueueThread -> futureDone[op]
  :: else -> released[op]
  fi
#endif
}

proctype Worker(byte me) {
  bool hot = false, handOver, issued;
  byte t, w, wake;
  do
  :: atomic {
       mayTake(hot) ->
       t = tasks[head];
       head++;
       if
       :: head == tail -> rescue = false
       :: else -> skip
       fi;
       busy = true;
       idle--
     }
     /* the task: the inner op, complete at once */
     atomic {
       busy = false;
       handOver = runnable && (waitingSteps > 0 || rescue);
       if
       :: handOver && idle == 0 -> addWorker()
       :: else -> skip
       fi;
       inThen++
     }
     if
     :: handOver -> atomic { wakeOne() }
     :: else -> skip
     fi;
     /* the completion step */
     issued = false;
#ifdef EARLY_RELEASE
     released[t] = true;
#endif
     futureDone[t] = true;
     if
     :: callback[t] == WAIT_SELF -> waitFor(t, true)
     :: callback[t] == WAIT_OP -> waitFor(arg[t], true)
     :: callback[t] == ISSUE_WAIT -> submit(arg[t], true, issued); waitFor(arg[t], true)
     :: callback[t] == NONE -> skip
     fi;
     callbackRan[t] = true;
     released[t] = true;
     atomic {
       inThen--;
       if
       :: issued -> waitingSteps--
       :: else -> skip
       fi;
       idle++;
       hot = true
     }
  :: atomic { !mayTake(hot) -> hot = false; sleeping[me] = true }
end_asleep:
     !sleeping[me]
  od
}

/* OpQueue::rescueLoop, its timing left out: it may act whenever a queue is
 * stuck (a runnable task, steps running, none of them waiting on the queue). */
proctype Rescuer() {
  byte w;
end_looking:
  do
  :: atomic {
       runnable && inThen > 0 && waitingSteps == 0 && !rescue ->
       assert(!servedWithoutRescue);
       rescue = true;
       if
       :: idle == 0 -> addWorker()
       :: else -> skip
       fi;
       wakeAll()
     }
  od
}

init {
  byte op, w, wake;
  bool none = false;
  if
  :: callback[0] = WAIT_SELF; callback[1] = NONE; callback[2] = NONE;
     byCaller[0] = true; servedWithoutRescue = true
  :: callback[0] = ISSUE_WAIT; arg[0] = 1; callback[1] = ISSUE_WAIT; arg[1] = 2;
     callback[2] = NONE; byCaller[0] = true; servedWithoutRescue = true
  :: callback[0] = WAIT_OP; arg[0] = 1; callback[1] = NONE; callback[2] = NONE;
     byCaller[0] = true; byCaller[1] = true
  :: callback[0] = WAIT_OP; arg[0] = 1; callback[1] = WAIT_OP; arg[1] = 0;
     callback[2] = NONE; byCaller[0] = true; byCaller[1] = true
  fi;
  atomic {
    addWorker(); /* OpQueue's constructor starts one */
#ifndef NO_RESCUE
    run Rescuer()
#endif
  }
  op = 0;
  do
  :: op < N_OPS && byCaller[op] -> submit(op, false, none); op++
  :: op < N_OPS && !byCaller[op] -> op++
  :: op >= N_OPS -> break
  od;
  op = 0;
  do
  :: op < N_OPS && byCaller[op] -> waitFor(op, false); assert(callbackRan[op]); op++
  :: op < N_OPS && !byCaller[op] -> op++
  :: op >= N_OPS -> break
  od
}
