/*
 * How a waiting rank sleeps and who wakes it (Wait.cpp: Engine::wake and
 * the sleeping loop of Engine::waitAll), as a model for spin.
 * scripts/check_protocol.sh checks it beside protocol.pml:
 *   liveness - no wake-up is lost: with every rank calling the same steps,
 *              every rank reaches its end although a sleeper blocks with no
 *              timeout here (the engine's sleeps end after 50 ms at most, so
 *              a lost wake-up costs that long, never a hang: the model says
 *              it never happens).
 *
 * The handshake. A publisher stores its counter, then (a seq_cst fence
 * between) reads `sleepers`, and only when it is not 0 bumps the futex word
 * `wakeSeq` and calls FUTEX_WAKE; with nobody asleep a publish touches no
 * line another rank writes. A waiter that gives up spinning adds itself to
 * `sleepers` (a seq_cst fence after), reads `wakeSeq`, checks its condition
 * once more, and sleeps with FUTEX_WAIT on the value it read. The fences make
 * these accesses sequentially consistent, as spin's interleavings are: the
 * publisher sees the sleeper, or the sleeper's last check sees the counter.
 * FUTEX_WAIT returns at once when the word no longer holds the value it was
 * given, and otherwise queues the caller atomically with that comparison
 * (the kernel's futex contract), so a bump between the waiter's read and its
 * FUTEX_WAIT is not lost either.
 *
 * Modelled: W ranks, each calling K steps: publish its counter for the step,
 * then wait until every rank's counter reached it (spin phase: one check;
 * then the sleeping loop).
 *
 * Each -D switch breaks one rule; the script checks that spin then finds the
 * lost wake-up (a rank asleep forever: an invalid end state):
 *   NO_RECHECK     - the waiter does not check again after announcing itself;
 *   SLEEPERS_FIRST - the publisher reads `sleepers` before it stores its
 *                    counter (the fence in the wrong place).
 */

#ifndef W
#define W 2
#endif
#ifndef K
#define K 3
#endif

byte counter[W];
byte wakeSeq;
byte sleepers;
bool queued[W]; /* in the futex's wait queue */

inline allReached(k, ok, q) {
  ok = true;
  q = 0;
  do
  :: q < W ->
     if
     :: counter[q] < k -> ok = false
     :: else -> skip
     fi;
     q++
  :: else -> break
  od
}

/* Engine::publish: the counter, then wake() */
inline publish(r, k, seen, q) {
#ifdef SLEEPERS_FIRST
  seen = sleepers;
  counter[r] = k;
#else
  counter[r] = k;
  seen = sleepers;
#endif
  if
  :: seen > 0 ->
     wakeSeq++;
     atomic { /* FUTEX_WAKE, INT_MAX */
       q = 0;
       do
       :: q < W -> queued[q] = false; q++
       :: else -> break
       od
     }
  :: else -> skip
  fi
}

proctype Rank(byte r) {
  byte k = 1;
  byte seq;
  byte seen;
  byte q;
  bool ok;
  do
  :: k <= K ->
     publish(r, k, seen, q);
     allReached(k, ok, q); /* the spin and yield phases */
     do
     :: ok -> break
     :: else ->
        sleepers++;
        seq = wakeSeq;
#ifndef NO_RECHECK
        allReached(k, ok, q);
#endif
        if
        :: ok -> skip
        :: else ->
           atomic { /* FUTEX_WAIT(wakeSeq, seq): compare and queue as one */
             if
             :: wakeSeq == seq -> queued[r] = true
             :: else -> skip
             fi
           };
           !queued[r] /* blocked until a FUTEX_WAKE dequeues it */
        fi;
        sleepers--;
        allReached(k, ok, q)
     od;
     k++
  :: else -> break
  od
}

init {
  byte i = 0;
  atomic {
    do
    :: i < W -> run Rank(i); i++
    :: else -> break
    od
  }
}
