// Package caughtuphttp gives web sessions read-your-writes on PostgreSQL
// read replicas: the token of a session's writes travels with the client,
// in a signed cookie (or a header, for API clients), and each request is
// routed by the same consume.Router as the process's jobs, so that a user
// who just saved something never sees the page without it, while the
// requests of everyone else read replicas. It is the pattern of GitLab's
// sticky database sessions and Rails' database selector, with a WAL
// position in place of a timestamp.
//
//	func serve(ctx context.Context, addr string, primary, r1, r2 *pgxpool.Pool) error {
//		router, err := consume.NewRouter(ctx, consume.Config{
//			Databases: map[string]replay.Database{"main": {Primary: primary, Replicas: replay.Replicas(r1, r2)}},
//		})
//		if err != nil {
//			return err
//		}
//		defer router.Close()
//		keys, err := sign.ParseKeys(os.Getenv("SESSION_TOKEN_KEYS")) // "id:base64secret", the first signs
//		if err != nil {
//			return err
//		}
//		mw, err := caughtuphttp.New(router, caughtuphttp.Config{Keys: keys})
//		if err != nil {
//			return err
//		}
//
//		// A handler writes on the primary through enqueue, and reads from the
//		// pool the router chose for the request.
//		mux := http.NewServeMux()
//		mux.HandleFunc("POST /users/{id}", func(w http.ResponseWriter, r *http.Request) {
//			_, err := enqueue.InTx(r.Context(), primary, func(tx pgx.Tx) error {
//				_, err := tx.Exec(r.Context(), "UPDATE users SET name = $1 WHERE id = $2", r.FormValue("name"), r.PathValue("id"))
//				return err
//			})
//			if err != nil {
//				http.Error(w, "not saved", http.StatusInternalServerError)
//				return
//			}
//			http.Redirect(w, r, r.URL.Path, http.StatusSeeOther) // the cookie goes with it
//		})
//		mux.HandleFunc("GET /users/{id}", func(w http.ResponseWriter, r *http.Request) {
//			var name string
//			err := consume.DB(r.Context(), "main").QueryRow(r.Context(), "SELECT name FROM users WHERE id = $1", r.PathValue("id")).Scan(&name)
//			if err != nil {
//				http.Error(w, "not found", http.StatusNotFound)
//				return
//			}
//			if _, err := io.WriteString(w, name); err != nil {
//				log.Printf("GET %s: %v", r.URL.Path, err)
//			}
//		})
//		return http.ListenAndServe(addr, mw.Handler(mux))
//	}
//
// # What a request reads
//
// A request without a session value has nothing of its own to wait for:
// each database reads from any replica the router may use (healthy, its
// state fresh; consume.Config's rules), and from the primary while none
// is. A request whose value names a write reads, per database, a replica
// that has replayed it. When none has, it waits for one (Config.Policy,
// default the router's: Delayed waits up to the router's WaitBudget;
// Sticky, GitLab's web behaviour, does not wait), then reads the primary,
// charged to the router's fallback cap like a job that cannot be
// deferred. There is no queue to defer a request to: while the cap is
// spent the request is held for a replica or the cap, up to
// Config.MaxWait, and then answered 503 with Retry-After
// (Config.Unavailable), never served stale.
//
// A value that is tampered with, expired, issued in the future, signed by
// a key this process does not have, or that does not decode is ignored,
// and the response clears the cookie. Any client can send such a value,
// so it never buys more than a request without one would get, except one
// primary read charged to the router's fallback cap
// (consume.Router.AllowFallback: consume.Config.PrimaryRate and
// PrimaryBurst, and the FleetBudget): within the cap the request reads the
// primary (the router counts it as primary_no_token), the safe answer
// for a real session lost to a retired key or a skewed clock; past the
// cap it reads as a request without a session, from any caught-up
// replica. A flood of garbage cookies thus reads the primary at most at
// the cap's rate, and shares that rate with the sessions and jobs that
// need it, which then wait, defer or are answered 503 as when the cap is
// spent by lag, never read stale. A value naming another cluster's
// position (another system identifier, or an epoch merged unknown) is
// treated alike for that database: within the cap it reads the primary
// there, past it that database reads as without a session; the client's
// next value leaves it out (while the tracker has not yet observed that
// database's primary, the router judges such an entry by the replicas and
// reads the primary there, as it then does for a request without a
// session). Each is counted
// (caughtup.http.tokens.rejected by caughtup.reason, and caughtup.result
// primary or session_less) and logged, sampled.
//
// A response that sets or clears the session cookie carries
// Cache-Control: private (added to what the handler set; public gives
// way; a handler's no-store or private stays), so that no shared cache
// hands one user's cookie to another. private, not no-store: the user's
// own browser may keep such a page, as it keeps the cookie.
//
// # Writes follow reads
//
// Handler opens an enqueue session for each request (enqueue.WithSession),
// so every write the handler makes through enqueue (InTx, Commit,
// Capturer.AfterWrite) is collected even from contexts it drops, and jobs
// it enqueues carry the session's earlier writes too (enqueue.TokenFrom).
// The new token, merged with the one the client brought (Token.Merge), is
// signed into the cookie when the handler first writes the header or the
// body, or flushes, or returns. So write before responding: a write after
// the header is out (or after hijacking the connection) cannot reach the
// client and is counted as caughtup.http.tokens.late. The wrapped
// ResponseWriter unwraps for http.ResponseController and implements
// http.Flusher and http.Hijacker.
//
// # The value
//
// base64url of (version, key ID, issued-at, max age, the token's text),
// a dot, and base64url of its HMAC-SHA256 under the key named. A process
// verifies a value once: it remembers, by their exact text, a bounded
// number of values whose signature verified, and checks only their age
// when they come back with the session's next requests. Keys are
// sign.Keys (`caughtup feed --generate-key`); list the new key second on
// every process, then first, then drop the old one after MaxAge. The
// cookie is Secure, HttpOnly, SameSite=Lax and named with the __Host-
// prefix by default.
//
// A session carries its token for Config.MaxAge after its last write
// (default 5 minutes), which must exceed the router's Tracker.MaxLagTime
// plus its StalenessBound: by the time a cookie expires, a replica that
// still lacks the write is behind by more than MaxLagTime, which the
// router counts as unhealthy and does not read. That holds while the
// tracker can measure the replica's lag: one whose lag it cannot compute
// (on another timeline than the primary's, not yet following a
// promotion) counts as healthy, and a request without a token may read
// it, as any read without a token may. The token itself says
// only where the session's writes are; it is signed so that a client
// cannot point other requests at positions of its choosing, not because
// it is secret.
//
// # Metrics
//
// Under ScopeName: caughtup.http.tokens.rejected (caughtup.reason
// malformed, unknown_key, bad_signature, expired, issued_in_future,
// bad_token, other_cluster; caughtup.result primary, session_less),
// caughtup.http.tokens.issued,
// caughtup.http.tokens.late and caughtup.http.requests.unavailable. The
// decisions themselves are the router's (caughtup.consume.decisions), with
// the source "http <route>" in its warnings; a rejected value's charge to
// the cap is counted in caughtup.consume.fallback.budget.
package caughtuphttp
