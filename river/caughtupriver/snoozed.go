package caughtupriver

import (
	"context"
	"encoding/json"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/caughtup/caughtup/position"
)

// snoozedKey is the job metadata key under which the Middleware keeps,
// when it snoozes a job it routed by a position read for the job (not by
// a producer's metadata token), that position and the snooze it belongs
// to (snoozed). The job's next fetch is routed by it, without a new read,
// if nothing but that snooze, or the wake that ended it, happened to the
// job in between (snoozedToken).
const snoozedKey = "caughtup-snoozed"

// snoozed is the value under snoozedKey.
type snoozed struct {
	// Token is the position, in the header encoding.
	Token string `json:"token"`
	// Attempt is the job's attempt when it was snoozed. River gives a
	// snoozed attempt back, so the job's next fetch has it again; any
	// other attempt means that the job ran (and failed, or was rescued)
	// since.
	Attempt int `json:"attempt"`
	// Snoozes is the job's metadata "snoozes" River writes with this
	// snooze.
	Snoozes int64 `json:"snoozes"`
	// Until is a lower bound of the scheduled_at River writes for the
	// snooze, in Unix microseconds: the Middleware's clock when it
	// returned the snooze, plus its duration (River adds the duration to
	// its clock, read later, in the same process).
	Until int64 `json:"until"`
}

// keepSnoozed records tok, the position job was routed by, in the
// metadata River writes with the snooze of duration d the Middleware is
// about to return (river.MetadataSet: River merges it into the job's
// metadata as it writes the snooze). Only for a snooze whose attempt ran
// no worker: an attempt that ran one may have written what its next
// attempt must read, which the position does not cover.
func keepSnoozed(ctx context.Context, job *rivertype.JobRow, tok position.Token, d time.Duration) {
	enc, err := tok.Encode()
	if err != nil {
		return
	}
	// Failing only outside a worker; the next fetch then reads anew.
	_ = river.MetadataSet(ctx, snoozedKey, snoozed{
		Token:   enc,
		Attempt: job.Attempt,
		Snoozes: snoozeCount(job.Metadata) + 1,
		Until:   time.Now().Add(d).UnixMicro(),
	})
}

// snoozedMetadata is the part of a job's metadata snoozedToken reads.
type snoozedMetadata struct {
	Snoozed *snoozed `json:"caughtup-snoozed"`
	Woken   *int64   `json:"caughtup-woken"`
}

// snoozedToken returns the position kept at job's last snooze if the job
// was fetched again straight out of that snooze: the same attempt (no
// attempt ran since, so no write of the job's own is missing), the same
// snooze count (no other snooze since), and brought back either by River
// when the snooze ended (its scheduled_at is the snooze's) or by the
// Middleware's wake (wokenKey names this snooze). A job made available
// early by anything else, River's JobRetry for instance, is read for
// anew, so that the writes of the transaction that retried it are
// covered; so is a unique job, whose skipped duplicates' writes are not
// (the caller checks).
//
// Why the kept position still covers the job: it was read after the
// job's first fetch of this chain, so it is at or past the commit of the
// transaction that inserted it (see fetchPositions), and nothing since
// has added a write the job depends on.
func snoozedToken(job *rivertype.JobRow) (position.Token, bool) {
	if len(job.Metadata) == 0 {
		return position.Token{}, false
	}
	var md snoozedMetadata
	if json.Unmarshal(job.Metadata, &md) != nil || md.Snoozed == nil {
		return position.Token{}, false
	}
	s := md.Snoozed
	if s.Attempt != job.Attempt || s.Snoozes != snoozeCount(job.Metadata) {
		return position.Token{}, false
	}
	woken := md.Woken != nil && *md.Woken == s.Snoozes
	if !woken && job.ScheduledAt.UnixMicro() < s.Until {
		return position.Token{}, false
	}
	tok, err := position.DecodeHeaders(s.Token)
	if err != nil || tok.IsZero() {
		return position.Token{}, false
	}
	return tok, true
}
