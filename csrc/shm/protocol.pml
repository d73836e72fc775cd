/*
 * The step protocol of Engine.hpp, as a model for the spin model checker.
 * scripts/check_protocol.sh checks it (tests/test_protocol_model.py runs that
 * in CI):
 *   safety   - no rank reads a slot, a part of a slot or a direct-read buffer
 *              that its owner is overwriting or has already overwritten for a
 *              later step (every read asserts the version it expects, before
 *              and after, so an overwrite in between is caught);
 *   liveness - no deadlock: with every rank calling the same sequence of
 *              steps, every rank reaches its end (spin's invalid end states);
 *   bound    - no counter a rank waits on exceeds its own posted step + 1:
 *              the engine rejects larger values as corruption (loadCounter).
 * Not modelled: the direct all-reduce (several steps of part-wise direct
 * reads and one final wait for every done), which combines REDUCE and
 * DIRECT below.
 * Each -D switch below breaks one rule of the protocol; the script checks
 * that spin then finds a violation, so the assertions are known to bite:
 *   NO_REDUCED_WAIT - read reduced parts without waiting for every reduced;
 *   NO_DIRECT_WAIT  - return from a direct step before every peer is done;
 *   ONE_SLOT        - one slot a rank instead of two;
 *   SKIP_STEP       - the last rank skips the last step (callers that break
 *                     c10d's contract): spin must report the deadlock.
 * NO_REUSE_WAIT (no overwrite rule) is safe, and the script checks that too:
 * a rank posts s + 1 only after it finished reading step s, and a rank posts
 * s + 2 only after it saw every rank's post of s + 1, so nobody still reads
 * step s's slot when it is overwritten: the rule is implied by the order of
 * the steps. The engine keeps the explicit wait (W loads that never block)
 * so that slot safety does not rest on that order alone; the done counter
 * is what direct steps need (NO_DIRECT_WAIT).
 *
 * With -DPOOL (checked too):
 *   NO_POOL_WAIT    - return from a pooled call before every peer is done;
 *   NO_POOL_RETRY   - a rank whose buffer is ordinary reads the slots of a
 *                     step in which a peer posted its pool buffer alone.
 * With -DPOOL -DPOOL_REDUCE (checked too), a pooled call is the pooled
 * all-reduce (Engine::allReducePooled), and its mixed form retries as
 * REDUCE:
 *   NO_POOL_REDUCED_WAIT - copy the reduced parts into my buffer without
 *                     waiting for every reduced: a peer may still be
 *                     reducing that part of my buffer.
 *
 * Modelled: W ranks, two slots each, and a sequence of K calls whose kinds
 * are chosen nondeterministically (spin explores every sequence); every
 * call but a mixed POOLED one is one step:
 *   SLOTS  - post, read every peer's slot, done (all-gather, broadcast,
 *            reduce-scatter, one-shot all-reduce, barrier);
 *   REDUCE - post, reduce my part of every slot into my own slot, reduced,
 *            wait for every reduced, read every rank's part from its slot,
 *            done (the two-round all-reduce);
 *   DIRECT - my buffer is written by my caller, post its address, read every
 *            peer's buffer, done, wait for every done before returning (the
 *            caller may then overwrite it): direct reads;
 *   POOLED - (-DPOOL) each rank's buffer is a pool buffer or not (every
 *            subset): a rank with one posts it alone (no slot data), one
 *            without fills its slot as for SLOTS; when every rank posted a
 *            pool buffer, read every peer's buffer, done, wait for every
 *            done (Engine::pooledStep); when none did, the step is SLOTS;
 *            else every rank closes the step and the call goes through the
 *            slots at the next step (Engine::post's retry). With
 *            POOL_REDUCE, "read every peer's buffer" is two rounds on the
 *            ranks' buffers: reduce part me of every buffer into part me
 *            of mine, reduced, wait for every reduced, copy part q of
 *            rank q's buffer into part q of mine.
 * A counter and the data it guards become visible together (release/acquire
 * in the engine); spin's interleaving semantics is sequentially consistent.
 */

#ifndef W
#define W 3
#endif
#ifndef K
#define K 4
#endif

#ifdef SKIP_STEP
#define LAST(r) (K - ((r) == W - 1))
#else
#define LAST(r) K
#endif

#define SLOTS 0
#define REDUCE 1
#define DIRECT 2
#define POOLED 3
#define WRITING 255

byte kind[K + 1];             /* kind of call c, 1..K (0 unused) */
byte posted[W];
byte reduced[W];
byte done[W];
byte ver[W * 2];              /* step whose data slot (r, i) holds */
byte part[W * 2 * W];         /* part p of slot (r, i): 2s raw, 2s+1 reduced */
byte buf[W];                  /* step whose data rank r's own buffer holds */
#ifdef POOL_REDUCE
byte bufpart[W * W];          /* part p of rank r's buffer: 2s raw, 2s+1 reduced */
#define BUFPART(r, p) ((r) * W + (p))
#endif
bool sigpool[W * 2];          /* slot (r, i)'s signature: r posted a pool buffer alone */
bool pool[(K + 1) * W];       /* POOLED call c: rank r's buffer is a pool buffer */
bool chosen = false;

#ifdef ONE_SLOT
#define SLOT(r, s) ((r) * 2) /* one slot a rank: the overwrite rule is too weak */
#else
#define SLOT(r, s) ((r) * 2 + (s) % 2)
#endif
#define PART(r, s, p) (SLOT(r, s) * W + (p))

/* Blocks until every rank's counter c reaches v (counters only grow, so
   waiting for each in turn is waiting for all). */
#define waitAll(c, v) \
  q = 0; \
  do \
  :: q < W -> assert(c[q] <= posted[me] + 1); (c[q] >= v); q++ \
  :: else -> break \
  od

/* Reads rank q's slot of step s, all of it or part p. */
inline readSlot(s) {
  assert(ver[SLOT(q, s)] == s);
  skip; /* the copy: others may run here */
  assert(ver[SLOT(q, s)] == s)
}
inline readPart(s, p, v) {
  assert(part[PART(q, s, p)] == v);
  skip;
  assert(part[PART(q, s, p)] == v)
}
#ifdef POOL_REDUCE
/* Reads part p of rank q's pool buffer, which must hold version v. */
inline readBufPart(p, v) {
  assert(bufpart[BUFPART(q, p)] == v);
  skip;
  assert(bufpart[BUFPART(q, p)] == v)
}
#endif

proctype Rank(byte me) {
  byte c = 1;   /* call */
  byte s = 1;   /* step */
  byte k;       /* kind of step s */
  byte q;
  byte p;
  bool mine;    /* POOLED: my buffer is a pool buffer, posted alone */
  bool all;
  bool any;
  bool more;    /* the call takes another step */
  (chosen);
  do
  :: c > LAST(me) -> break
  :: else ->
    k = kind[c];
    mine = (k == POOLED && pool[c * W + me]);
    if
    :: k == DIRECT || mine ->
      /* The caller writes the buffer for this call: legal only once every
         peer finished reading it for the last one (the wait at the end). */
      buf[me] = WRITING;
#ifdef POOL_REDUCE
      p = 0;
      do
      :: p < W -> bufpart[BUFPART(me, p)] = 2 * s; p++
      :: else -> break
      od;
#endif
      buf[me] = s
    :: else -> skip
    fi;
    more = true;
    do
    :: !more -> break
    :: else ->
      more = false;
      /* 1. the overwrite rule: slot s % 2 was last read in step s - 2 */
#ifndef NO_REUSE_WAIT
      if
      :: s > 2 -> waitAll(done, s - 2)
      :: else -> skip
      fi;
#endif
      /* 2. fill my slot (not when I post a pool buffer alone), then post;
         the signature says whether I posted a pool buffer */
      if
      :: mine -> skip
      :: else ->
        ver[SLOT(me, s)] = WRITING;
        p = 0;
        do
        :: p < W -> part[PART(me, s, p)] = 2 * s; p++
        :: else -> break
        od;
        ver[SLOT(me, s)] = s
      fi;
      sigpool[SLOT(me, s)] = mine;
      posted[me] = s;
      /* 3. wait for every rank's post */
      waitAll(posted, s);
      /* A pooled call reads pool buffers only if every rank posted one;
         else every rank closes this step, which nobody reads, and the call
         goes through the slots from the next step. */
      all = true;
      any = false;
      if
      :: k == POOLED ->
        q = 0;
        do
        :: q < W -> all = all && sigpool[SLOT(q, s)]; any = any || sigpool[SLOT(q, s)]; q++
        :: else -> break
        od
      :: else -> skip
      fi;
#ifdef POOL_REDUCE
      /* an all-reduce with no pool buffer: the ordinary two rounds */
      if
      :: k == POOLED && !any -> k = REDUCE
      :: else -> skip
      fi;
#endif
      /* 4. read */
      if
      :: k == POOLED && all ->
#ifdef POOL_REDUCE
        /* my part of every rank's buffer, reduced into mine in place */
        q = 0;
        do
        :: q < W -> readBufPart(me, 2 * s); q++
        :: else -> break
        od;
        bufpart[BUFPART(me, me)] = 2 * s + 1;
        reduced[me] = s;
#ifndef NO_POOL_REDUCED_WAIT
        waitAll(reduced, s);
#endif
        /* every other part from its owner's buffer into mine */
        q = 0;
        do
        :: q < W && q != me ->
          readBufPart(q, 2 * s + 1);
          bufpart[BUFPART(me, q)] = WRITING;
          bufpart[BUFPART(me, q)] = 2 * s + 1;
          q++
        :: q == me -> q++
        :: else -> break
        od
#else
        q = 0;
        do
        :: q < W ->
          assert(buf[q] == s);
          skip; /* the plain loads from q's mapped buffer */
          assert(buf[q] == s);
          q++
        :: else -> break
        od
#endif
#ifdef NO_POOL_RETRY
      :: k == POOLED && any && !all && mine -> more = true; mine = false; k = SLOTS
      :: k == POOLED && any && !all && !mine -> k = SLOTS; goto slots
#elif defined(POOL_REDUCE)
      :: k == POOLED && any && !all -> more = true; mine = false; k = REDUCE
#else
      :: k == POOLED && any && !all -> more = true; mine = false; k = SLOTS
#endif
      :: k == SLOTS || (k == POOLED && !any) ->
slots:
        q = 0;
        do
        :: q < W -> readSlot(s); q++
        :: else -> break
        od
      :: k == REDUCE ->
        q = 0;
        do
        :: q < W -> readPart(s, me, 2 * s); q++
        :: else -> break
        od;
        part[PART(me, s, me)] = 2 * s + 1;
        reduced[me] = s;
#ifndef NO_REDUCED_WAIT
        waitAll(reduced, s);
#endif
        q = 0;
        do
        :: q < W -> readPart(s, q, 2 * s + 1); q++
        :: else -> break
        od
      :: k == DIRECT ->
        q = 0;
        do
        :: q < W ->
          assert(buf[q] == s);
          skip;
          assert(buf[q] == s);
          q++
        :: else -> break
        od
      fi;
      /* 5. done */
      done[me] = s;
      if
#ifndef NO_DIRECT_WAIT
      :: k == DIRECT -> waitAll(done, s)
#endif
#ifndef NO_POOL_WAIT
      :: k == POOLED && all -> waitAll(done, s)
#endif
      :: else -> skip
      fi;
      s++
    od;
    c++
  od
}

init {
  byte s = 1;
  byte r;
  /* Every sequence of K step kinds; all ranks run the same one. */
  do
  :: s <= K ->
    if
    :: kind[s] = SLOTS
    :: kind[s] = REDUCE
    :: kind[s] = DIRECT
#ifdef POOL
    :: kind[s] = POOLED;
      /* which ranks' buffers are pool buffers: any subset */
      r = 0;
      do
      :: r < W ->
        if
        :: pool[s * W + r] = true
        :: pool[s * W + r] = false
        fi;
        r++
      :: else -> break
      od
#endif
    fi;
    s++
  :: else -> break
  od;
  chosen = true;
  atomic {
    r = 0;
    do
    :: r < W -> run Rank(r); r++
    :: else -> break
    od
  }
}
