package consume

import (
	"strconv"
	"strings"
)

// Policy says how hard a job insists on a replica. The names are GitLab's
// data-consistency levels.
type Policy uint8

const (
	// PolicyDefault is the zero value: use Config.DefaultPolicy. Adapters
	// pass it for jobs that name no policy of their own.
	PolicyDefault Policy = iota
	// Always reads every database from the primary. The token is ignored
	// for routing (but still passed on to jobs the handler enqueues).
	Always
	// Sticky reads from a replica that has caught up with the token and
	// otherwise from the primary at once: never delayed, more primary load.
	Sticky
	// Delayed reads from a caught-up replica; otherwise it waits up to
	// Config.WaitBudget for one, then defers the job with a delay that
	// grows with the token's age, and only once the token is older than
	// Config.MaxAge reads from the primary.
	Delayed
)

var policyNames = [...]string{"default", "always", "sticky", "delayed"}

// String is the policy's name in metrics (caughtup.policy), logs and
// configuration ("default", "always", "sticky", "delayed"); "invalid" for
// other values.
func (p Policy) String() string {
	if int(p) < len(policyNames) {
		return policyNames[p]
	}
	return "invalid"
}

// ParsePolicy accepts "always", "sticky", "delayed" (any case) and ""
// or "default" for PolicyDefault.
func ParsePolicy(s string) (Policy, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "default":
		return PolicyDefault, nil
	case "always":
		return Always, nil
	case "sticky":
		return Sticky, nil
	case "delayed":
		return Delayed, nil
	}
	return PolicyDefault, &PolicyError{Input: s}
}

// PolicyError reports text that names no policy.
type PolicyError struct {
	// Input is the text given (Error prints at most 64 bytes of it).
	Input string
}

// Error names the text and the policies that exist.
func (e *PolicyError) Error() string {
	in := e.Input
	if len(in) > 64 {
		in = in[:64] + "…"
	}
	return `caughtup/consume: unknown policy "` + in + `": want always, sticky or delayed`
}

// MarshalText implements encoding.TextMarshaler.
func (p Policy) MarshalText() ([]byte, error) {
	if int(p) >= len(policyNames) {
		return nil, &PolicyError{Input: "Policy(" + strconv.Itoa(int(p)) + ")"}
	}
	return []byte(p.String()), nil
}

// UnmarshalText implements encoding.TextUnmarshaler.
func (p *Policy) UnmarshalText(b []byte) error {
	v, err := ParsePolicy(string(b))
	if err != nil {
		return err
	}
	*p = v
	return nil
}

func (p Policy) valid() bool { return int(p) < len(policyNames) }

// Outcome names what happened to a job, for metrics (caughtup.outcome) and
// logs. It follows GitLab's strategy log field where one exists. String
// gives the name metrics and logs use.
type Outcome uint8

const (
	// OutcomeReplica: every database the token names is read from a
	// replica that had already caught up.
	OutcomeReplica Outcome = iota
	// OutcomeReplicaWaited: as OutcomeReplica, after waiting for a replica
	// to catch up.
	OutcomeReplicaWaited
	// OutcomeDeferred: the job does not run now; run it again after
	// Decision.Delay.
	OutcomeDeferred
	// OutcomePrimary: at least one database is read from the primary
	// because of the policy, replica lag or unknown replica state; Reason
	// says which.
	OutcomePrimary
	// OutcomePrimaryNoToken: the job carries no usable token (none, or
	// malformed), so it cannot be checked against any replica.
	OutcomePrimaryNoToken
	// OutcomePrimaryEpoch: the token's position belongs to a history the
	// replicas cannot be compared with (another cluster, a timeline past
	// its switchpoint, an unknown epoch).
	OutcomePrimaryEpoch
	// OutcomeCapped: the job needs the primary but the fallback cap is
	// exhausted and it may not be deferred any longer (Sticky, or Delayed
	// past Config.MaxAge). It does not run now; adapters return a
	// retryable error. Never a stale read.
	OutcomeCapped
	// OutcomeRefused: no node the router knows can serve the job and it
	// may not be deferred any longer: its token is ahead of the router's
	// primary (ReasonPrimaryBehind). Adapters return a retryable error.
	OutcomeRefused

	// outcomeWait is Decide's "wait for the tracker" result; the Router
	// never reports it.
	outcomeWait

	numOutcomes = int(outcomeWait) + 1
)

var outcomeNames = [numOutcomes]string{
	OutcomeReplica:        "replica",
	OutcomeReplicaWaited:  "replica_waited",
	OutcomeDeferred:       "deferred",
	OutcomePrimary:        "primary",
	OutcomePrimaryNoToken: "primary_no_token",
	OutcomePrimaryEpoch:   "primary_epoch",
	OutcomeCapped:         "capped",
	OutcomeRefused:        "refused",
	outcomeWait:           "wait",
}

// String is the outcome's name in metrics and logs ("replica",
// "primary_no_token", …).
func (o Outcome) String() string {
	if int(o) < len(outcomeNames) {
		return outcomeNames[o]
	}
	return "Outcome(" + strconv.Itoa(int(o)) + ")"
}

// MarshalText implements encoding.TextMarshaler, so that JSON logs and
// reports carry the name.
func (o Outcome) MarshalText() ([]byte, error) { return []byte(o.String()), nil }

// Reason explains an outcome (caughtup.reason). String gives the name
// metrics and logs use.
type Reason uint8

const (
	// ReasonNone: nothing to explain (a replica was used).
	ReasonNone Reason = iota
	// ReasonNoToken: the job carries no token.
	ReasonNoToken
	// ReasonMalformedToken: the job's token could not be decoded.
	ReasonMalformedToken
	// ReasonPolicyAlways: the policy is Always.
	ReasonPolicyAlways
	// ReasonReplicaBehind: healthy replicas exist but none has replayed
	// the token's position yet.
	ReasonReplicaBehind
	// ReasonDeadline: the token is older than Config.MaxAge, so the job
	// stops waiting for replicas.
	ReasonDeadline
	// ReasonUnknownAge: the token has no capture time, or one more than
	// Config.ClockSkewTolerance ahead of the consumer's clock, so a
	// Delayed job cannot be deferred (its deferral would have no bound)
	// and goes to the primary after the wait.
	ReasonUnknownAge
	// ReasonEpoch: the token's epoch cannot be compared with the
	// replicas' (DatabaseDecision.Incomparable says how).
	ReasonEpoch
	// ReasonNoHealthyReplica: no replica's state is known and usable: all
	// are failing, not in recovery, of unknown epoch or over the lag
	// thresholds.
	ReasonNoHealthyReplica
	// ReasonTrackerStale: every replica's last observation is older than
	// Config.StalenessBound.
	ReasonTrackerStale
	// ReasonNoReplicas: the database is configured without replicas.
	ReasonNoReplicas
	// ReasonUnknownDatabase: the token names a database missing from
	// Config.Databases; that database cannot be read through the router.
	ReasonUnknownDatabase
	// ReasonCapped: the fallback cap refused a promotion to the primary.
	ReasonCapped
	// ReasonDivergedStandby: no replica could serve the job, and at least
	// one was a diverged standby: on an older timeline than the primary's,
	// past the point where the primary's history left it (a standby still
	// following the old primary after a failover). It holds rows the new
	// primary never had and will never reach the new timeline, so it is
	// neither read nor waited on; the job reads the primary at once.
	ReasonDivergedStandby
	// ReasonReplicaRestarted: the only replicas that could catch up with
	// the token are held after a restart until they replay what they had
	// before (ReplicaState.RestartFloor); the job waits or defers as for
	// ReasonReplicaBehind.
	ReasonReplicaRestarted
	// ReasonUnverified: the replica chosen could not confirm what its
	// position suggested (Job.Verify: the Verifier answered
	// VerifyUnknown, e.g. the commit status of a CDC event's transaction
	// is unknown there or the replica did not answer); the database
	// reads the primary.
	ReasonUnverified
	// ReasonCannotDefer: no replica could serve the job, which a Delayed
	// policy would defer, but the job cannot be deferred (Job.NoDefer, or
	// its deferral would end after Job.DeferBy: an asynq task on its last
	// attempt or near its deadline); it reads the primary under the
	// fallback cap.
	ReasonCannotDefer
	// ReasonPrimaryBehind: the token is from a newer timeline than the
	// router's primary: a failover the router has not seen (its primary
	// pool may still reach the old primary, which lacks the token's
	// writes). The job waits and is deferred like one whose replicas are
	// behind, and where it would read the primary it is refused instead
	// (ErrPrimaryBehind). A replica that follows the new timeline and has
	// replayed the token serves it.
	ReasonPrimaryBehind
	// ReasonMissingGrant: no replica could serve the job, and at least one
	// is unknown because the tracker's role lacks a privilege
	// (replay.ErrMissingGrant: its Snapshot Err and a warning logged once
	// name the GRANT to run). Like ReasonNoReplicas it is not capped: no
	// wait would change it.
	ReasonMissingGrant

	numReasons = int(ReasonMissingGrant) + 1
)

var reasonNames = [numReasons]string{
	ReasonNone:             "none",
	ReasonNoToken:          "no_token",
	ReasonMalformedToken:   "malformed_token",
	ReasonPolicyAlways:     "policy_always",
	ReasonReplicaBehind:    "replica_behind",
	ReasonDeadline:         "deadline",
	ReasonUnknownAge:       "unknown_age",
	ReasonEpoch:            "epoch",
	ReasonNoHealthyReplica: "no_healthy_replica",
	ReasonTrackerStale:     "tracker_stale",
	ReasonNoReplicas:       "no_replicas",
	ReasonUnknownDatabase:  "unknown_database",
	ReasonCapped:           "capped",
	ReasonDivergedStandby:  "diverged_standby",
	ReasonReplicaRestarted: "replica_restarted",
	ReasonUnverified:       "unverified",
	ReasonCannotDefer:      "cannot_defer",
	ReasonPrimaryBehind:    "primary_behind",
	ReasonMissingGrant:     "missing_grant",
}

// String is the reason's name in metrics and logs ("replica_behind", …).
func (r Reason) String() string {
	if int(r) < len(reasonNames) {
		return reasonNames[r]
	}
	return "Reason(" + strconv.Itoa(int(r)) + ")"
}

// MarshalText implements encoding.TextMarshaler.
func (r Reason) MarshalText() ([]byte, error) { return []byte(r.String()), nil }

// fallback reports whether a primary read for this reason is a promotion
// caused by lag or unknown replica state, the only kind the fallback cap
// limits. Missing tokens, Always, epochs, unknown databases and databases
// without replicas send work to the primary that no amount of waiting
// would move to a replica, so capping them would only refuse work.
func (r Reason) fallback() bool {
	switch r {
	case ReasonReplicaBehind, ReasonDeadline, ReasonUnknownAge, ReasonNoHealthyReplica, ReasonTrackerStale,
		ReasonDivergedStandby, ReasonReplicaRestarted, ReasonUnverified, ReasonCannotDefer:
		return true
	}
	return false
}

// Action is what the caller of Decide must do next.
type Action uint8

const (
	// ActionRun: run the job now, each database on the pool named in
	// Decision.Databases (the primary for databases not listed).
	ActionRun Action = iota
	// ActionWait: wait for the tracker to see a replica pass the token,
	// then decide again (the Router does this; see Config.WaitBudget).
	ActionWait
	// ActionDefer: do not run now; run again after Decision.Delay.
	ActionDefer
	// ActionRefuse: the cap refused the primary and the job may not be
	// deferred; fail it with a retryable error (OutcomeCapped).
	ActionRefuse
)

var actionNames = [...]string{"run", "wait", "defer", "refuse"}

// String is the action's name ("run", "wait", "defer", "refuse");
// "invalid" for other values.
func (a Action) String() string {
	if int(a) < len(actionNames) {
		return actionNames[a]
	}
	return "invalid"
}
