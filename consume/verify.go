package consume

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/position"
)

// Verdict is a Verifier's answer about one replica.
type Verdict uint8

const (
	// VerifyUnknown: the replica cannot tell (it did not answer, or what
	// it answered proves nothing); the database reads the primary
	// (ReasonUnverified). It is the zero value, so a Verification nobody
	// filled in never reads a replica.
	VerifyUnknown Verdict = iota
	// VerifyBehind: the replica does not show the job's writes yet. The
	// job waits, is deferred or reads the primary as for any replica
	// that is behind (the policy decides).
	VerifyBehind
	// VerifyFresh: the replica shows the job's writes; the handler reads
	// it.
	VerifyFresh
)

// String is the verdict's name ("unknown", "behind", "fresh").
func (v Verdict) String() string {
	switch v {
	case VerifyBehind:
		return "behind"
	case VerifyFresh:
		return "fresh"
	}
	return "unknown"
}

// Verification is what a Verifier found on one replica.
type Verification struct {
	Verdict Verdict
	// Replayed is, for VerifyBehind, a position the replica had replayed
	// when it was found without the job's writes (its
	// pg_last_wal_replay_lsn() read before the check); zero when not
	// known. The writes then end past it, on every replica of this
	// history, since all of them replay the same WAL: the router counts
	// every replica that has not replayed past it (or past the position
	// the tracker had seen on this one, if higher) as behind for this job,
	// and verifies again only on one that has.
	Replayed position.LSN
	// Err says why, for VerifyUnknown; it goes into the router's warning.
	Err error
}

// A Verifier confirms, on the replica a decision chose for one database,
// that the replica shows the job's writes. It is for tokens whose
// position is necessary but not sufficient: a Debezium event's
// source.lsn is its change record, below its commit, so a replica past
// it may still show the transaction as in progress (see package cdc,
// whose Checker answers the question). dd is the database's decision (its
// Entry, the replica's name and the position the tracker saw there,
// ReadAt) and replica the pool the handler would read. It runs on the
// routing path, once per decision that puts a database on a replica: keep
// it to a query or two, bounded in time.
//
// Routed with a Verifier (Job.Verify), a job gets a replica only once the
// Verifier calls it fresh. A replica found behind counts as behind for the
// job, with every replica that has not replayed past it
// (Verification.Replayed): the job waits for one that has (within its one
// Config.WaitBudget), is verified again there, and is deferred or reads the
// primary as the policy says, under the fallback cap. A replica that cannot
// tell (VerifyUnknown) sends its database to the primary
// (ReasonUnverified, a warning with the Verifier's error).
type Verifier func(ctx context.Context, dd DatabaseDecision, replica *pgxpool.Pool) Verification

// EntryCheck is what verification added to the routing of one token
// entry (DecideInput.Verified).
type EntryCheck struct {
	// After: the entry needs a replica that has replayed past this
	// position; one at or below it was found without the job's writes.
	// Zero: no such bound.
	After position.LSN
	// Unknown: a replica chosen for the entry could not tell; the entry
	// reads the primary (ReasonUnverified).
	Unknown bool
}

// errUnverified stands in for a VerifyUnknown that gave no error.
var errUnverified = errors.New("caughtup/consume: the Verifier could not confirm the replica (VerifyUnknown without an error)")

// verified carries a job's first decision d through waiting and
// verification, until a decision whose replicas v has all called fresh,
// or one that does not run on a replica (the primary, a deferral): never
// ActionWait. Every wait shares the one Config.WaitBudget of the job,
// through a deadline on the waits' context (wait ends its budget at a
// deadline, as at its timer). It returns the decision, whether it waited,
// the error of the last VerifyUnknown (for the warning), and ctx's error
// if ctx was cancelled during a wait.
func (r *Router) verified(ctx context.Context, in *DecideInput, d Decision, v Verifier) (Decision, bool, error, error) {
	var (
		waited    bool
		waitedFor time.Duration
		verifyErr error
		wctx      context.Context
	)
	for {
		if d.Action == ActionWait {
			if wctx == nil {
				var cancel context.CancelFunc
				wctx, cancel = context.WithTimeout(ctx, r.cfg.WaitBudget)
				defer cancel()
			}
			waited = true
			var err error
			d, err = r.wait(wctx, in, d)
			waitedFor += d.Waited
			d.Waited = waitedFor
			if err != nil {
				r.log.DebugContext(ctx, "caughtup: wait for a replica abandoned", slog.Any("error", err),
					slog.String(attrPolicy, d.Policy.String()), slog.Duration("waited", d.Waited))
				return d, waited, verifyErr, err
			}
		}
		if d.Action != ActionRun {
			return d, waited, verifyErr, nil
		}
		again, err := r.verify(ctx, in, &d, v)
		if err != nil {
			verifyErr = err
		}
		if !again {
			return d, waited, verifyErr, nil
		}
		d = Decide(*in)
		d.Waited = waitedFor
	}
}

// verify asks v about every database d runs on a replica. again reports
// that a verdict added to in.Verified, so that the job must be decided
// anew; err is the error of the last VerifyUnknown.
func (r *Router) verify(ctx context.Context, in *DecideInput, d *Decision, v Verifier) (again bool, err error) {
	// Decide appends one DatabaseDecision per token entry, in order, so
	// i indexes in.Token.Entries too.
	for i := range d.Databases {
		dd := &d.Databases[i]
		if dd.replica < 0 {
			continue
		}
		db := r.pools[dd.Database]
		if db == nil || int(dd.replica) >= len(db.Replicas) || i >= len(in.Token.Entries) {
			continue // Decide never chooses such a replica
		}
		// The verifier's reads go through the handlers' pool of the
		// replica, so they too are tied to the server the decision judged.
		vctx := context.WithValue(ctx, routingKey{}, &routing{src: &r.direct, d: *d})
		res := v(vctx, *dd, db.Replicas[dd.replica].Pool)
		if res.Verdict == VerifyFresh {
			continue
		}
		if in.Verified == nil {
			in.Verified = make([]EntryCheck, len(in.Token.Entries))
		}
		vc := &in.Verified[i]
		if res.Verdict == VerifyBehind {
			// Past both what the check read and what the tracker saw: the
			// next replica verified must have replayed more than this one,
			// so the rounds end.
			vc.After = max(vc.After, dd.ReadAt.LSN, res.Replayed)
		} else {
			vc.Unknown = true
			err = res.Err
			if err == nil {
				err = errUnverified
			}
		}
		again = true
	}
	return again, err
}

// readPositions is the child token of a verified job: what each replica
// read had replayed when chosen, captured now.
func readPositions(d *Decision, now time.Time) position.Token {
	var reads [2]position.Entry
	read := reads[:0]
	for _, dd := range d.Databases {
		if dd.replica >= 0 {
			read = append(read, position.Entry{Database: dd.Database, Epoch: dd.ReadAt.Epoch, LSN: dd.ReadAt.LSN, Source: position.SourceReplica})
		}
	}
	if len(read) == 0 {
		return position.Token{}
	}
	return position.Of(now, read...)
}
