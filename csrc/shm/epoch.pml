/*
 * A membership change (ProcessGroupHSDP::reconfigure) as the shared-memory
 * engine sees it, as a model for spin. scripts/check_protocol.sh checks it
 * beside protocol.pml:
 *   safety   - no survivor reads, in the new membership's segment, a word
 *              the lost rank wrote, or one of the old membership's: the lost
 *              rank keeps its mapping of the old segment and writes to it
 *              at any time, anywhere in it;
 *   liveness - every survivor reaches its end: an op of the old membership
 *              pending on its worker (waiting for the lost rank, which may
 *              never post) ends, and the survivors meet in one new segment.
 *
 * Modelled: three ranks mapped segment A (the first membership); rank 2 is
 * lost but alive, and writes A's slots and counters whenever it likes. Each
 * survivor has a worker waiting in an op on A for every rank's post, and a
 * caller that reconfigures: leave A (ShmRoute::leave: mark A broken, which
 * ends the worker's wait, then drain the queue), then the rendezvous of
 * connectShm on the store of the new membership (membership/ShmRendezvous.cpp: an
 * incarnation ticket, keys under ticket / size; the new rank 0 creates the
 * segment and publishes its name, the other opens it), then one op on the
 * new segment: post, wait for every member's post, read the peer's slot.
 * The store of the new membership is PrefixStore("hsdp/reconfigure/<uuid>/"),
 * whose incarnation counter starts at 0 (uuids are never reused).
 *
 * Each -D switch breaks one rule; the script checks that spin then finds it:
 *   SHARED_COUNTER - the new membership's rendezvous runs on the old store
 *                    keys: the incarnation counter stands at 3 (three ranks
 *                    took tickets), the two survivors' tickets 3 and 4 give
 *                    keys 3 / 2 = 1 and 4 / 2 = 2, and each waits for a name
 *                    under a key the other never writes (a deadlock);
 *   REUSED_UUID    - the uuid of an earlier reconfigure is used again (which
 *                    reconfigure refuses): the lost rank, retrying it, finds
 *                    the new segment under the same keys and writes into it
 *                    (the assertion fails);
 *   NO_LEAVE       - the caller drains the queue without first marking A
 *                    broken: the worker waits for the lost rank for ever.
 */

#define SURVIVORS 2
#define LOST 2
#define A 1 /* segment ids; 0: none */
#define B 2

/* Per segment and rank: the posted counter and the slot's writer and
 * membership (epoch). Index 0 of the segment is unused. */
bool posted[3 * 3];
byte writer[3 * 3];
byte epochOf[3 * 3];
bool broken[3];
#define AT(seg, r) ((seg) * 3 + (r))

byte counter = 0;   /* the new store's incarnation counter */
byte oldCounter = 3; /* the old store's: three ranks took a ticket */
byte names[3];      /* store keys "name" under prefixes 0..2: a segment id */
bool workerDone[SURVIVORS];

proctype Lost() {
  /* Alive with its mapping of A: any write, any time, or none. */
  do
  :: posted[AT(A, LOST)] = true
  :: writer[AT(A, 0)] = LOST; epochOf[AT(A, 0)] = 1
  :: writer[AT(A, 1)] = LOST; epochOf[AT(A, 1)] = 1
#ifdef REUSED_UUID
  /* Its own retry of a reconfigure under the same uuid finds the name the
   * new membership published under the same keys, maps B and writes. */
  :: names[0] != 0 -> writer[AT(names[0], 0)] = LOST; epochOf[AT(names[0], 0)] = 2
#endif
  :: break
  od
}

/* The op on A pending on survivor r's worker: it waits for every rank's
 * post, or for A to be broken. */
proctype Worker(byte r) {
  posted[AT(A, r)] = true;
  if
  :: posted[AT(A, 0)] && posted[AT(A, 1)] && posted[AT(A, LOST)]
  :: broken[A]
  fi;
  workerDone[r] = true
}

proctype Survivor(byte r) {
  byte ticket, key, seg, peer;
#ifndef NO_LEAVE
  broken[A] = true; /* leave(): every wait on A ends */
#endif
  workerDone[r]; /* the queue drained */
  /* A unmapped: nothing of it is read from here on. */
  atomic {
#ifdef SHARED_COUNTER
    ticket = oldCounter;
    oldCounter++;
#else
    ticket = counter;
    counter++;
#endif
  }
  key = ticket / SURVIVORS;
  if
  :: r == 0 -> seg = B; names[key] = B /* the new rank 0 creates and names it */
  :: else -> names[key] != 0; seg = names[key]
  fi;
  writer[AT(seg, r)] = r;
  epochOf[AT(seg, r)] = 2;
  posted[AT(seg, r)] = true;
  posted[AT(seg, 0)] && posted[AT(seg, 1)];
  peer = 1 - r;
  assert(seg == B && epochOf[AT(seg, peer)] == 2 && writer[AT(seg, peer)] == peer)
}

init {
  atomic {
    posted[AT(A, 0)] = false;
    run Lost();
    run Worker(0);
    run Worker(1);
    run Survivor(0);
    run Survivor(1)
  }
}
