// Package replicapool builds the pool a consume.Router hands its handlers
// for one replica, and ties every connection a routed handler gets from
// it to a server known to have replayed the job's token. Applications do
// not use it directly: the Router makes one Pool per configured replica.
//
// A replica "pool" may reach more than one server: a load balancer, a
// Kubernetes Service, a multi-host DSN, a DNS name that moves, PgBouncer
// over several standbys. What the tracker saw on its own connection then
// says nothing about the connection a handler gets, so each connection is
// checked when a routed handler acquires it:
//
//   - A direct connection (its server process is the one the protocol's
//     key data named) reaches one server for its whole life. Its server
//     run (replay.Incarnation and system identifier) is read once, when it
//     connects. If that run is the one the decision judged, or one this
//     pool has seen replay at least what the job needs, the connection is
//     admitted with no query; otherwise one query reads what its server
//     has replayed.
//   - A pooled connection (a pooler such as PgBouncer answers for the
//     server and makes up the key data) may reach another server in every
//     transaction. Its check opens the transaction the handler's reads
//     then run in (BEGIN and the position in one round trip), so that the
//     pooler cannot move them to another server, and the transaction ends
//     when the connection is released (ROLLBACK: the reads are on a
//     standby). That is two round trips per routed acquire. A direct
//     connection whose server process changes between two checks is
//     treated the same way from then on, with the whole pool.
//   - A connection whose server is behind is given back (closed, so that
//     a balancer or pooler picks a server again for the next one) and
//     another one is taken, up to MaxRefusals per job; then the acquire
//     fails with ErrReplicaBehind, the job's Attempt records the failure
//     and the router re-routes the job without spending an attempt.
//
// A Pool also remembers, per server run, the highest position it has seen
// it replay (its server table), which lets a router route to a balanced
// endpoint while the server the tracker watches is behind but another one
// behind the endpoint is not (Lift), and find such a server for a job
// that waits (Probe). Facts in the table never expire in meaning (replay
// only grows within a run): time only decides whether a server still
// counts as reachable behind the endpoint.
//
// And it keeps the replica's health as this process sees it: a replica
// whose connections cannot be made, or whose connections reached only
// servers behind the job for BehindRun jobs in a row (a balancer whose
// choice moved to lagging servers; one such job alone is chance, and is
// routed again), is left out of the router's decisions, for longer after
// each failure in a row (1s, doubling, at most MaxExclusion); an
// unreachable one comes back only once a re-probe connects. The exclusion is logged and counted once
// when it starts and once when it ends.
//
// See docs/deployments.md for what each topology costs.
package replicapool
