// Command web-session is caughtup's net/http middleware end to end: browser
// sessions, each with a cookie jar of its own, save a note (POST, then the
// redirect to it) and read it back at once, while the server reads every
// page from the pool the middleware chose for the request. It prints
//
//	sessions=100 writes=300 stale=0
//
// on stdout (a stale read was a page that did not show the note its own
// session had just saved) and where the reads went on stderr.
//
// One command runs it on the demo's cluster (a primary with two streaming
// replicas, replay paused at random on the replicas):
//
//	make example EXAMPLE=web-session
//
// that is,
//
//	go run ./cmd/caughtup-demo cluster -max-pause 1s -- go run ./examples/web-session
//
// On your own services:
//
//	CAUGHTUP_PRIMARY_URL=postgres://app@primary/app \
//	CAUGHTUP_REPLICA_URLS=postgres://app@replica1/app,postgres://app@replica2/app \
//	go run ./examples/web-session -sessions 1000
//
// It creates the table caughtup_example_notes (dropping an old one).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/cookiejar"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/sign"
	"github.com/caughtup/caughtup/web/caughtuphttp"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "web-session:", err)
		os.Exit(1)
	}
}

const table = "caughtup_example_notes"

type options struct {
	sessions, writes, concurrency int
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	var o options
	fs := flag.NewFlagSet("web-session", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&o.sessions, "sessions", 100, "browser sessions")
	fs.IntVar(&o.writes, "writes", 3, "notes each session saves and reads back")
	fs.IntVar(&o.concurrency, "concurrency", 8, "sessions at once")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.sessions < 1 || o.writes < 1 || o.concurrency < 1 {
		return errors.New("-sessions, -writes and -concurrency must be positive")
	}
	primaryURL, err := need(getenv, "CAUGHTUP_PRIMARY_URL", "the primary's URL")
	if err != nil {
		return err
	}
	replicaURLs, err := need(getenv, "CAUGHTUP_REPLICA_URLS", "its streaming replicas' URLs, comma-separated")
	if err != nil {
		return err
	}

	primary, err := pgxpool.New(ctx, primaryURL)
	if err != nil {
		return fmt.Errorf("CAUGHTUP_PRIMARY_URL: %w", err)
	}
	defer primary.Close()
	var replicas []*pgxpool.Pool
	for _, u := range strings.Split(replicaURLs, ",") {
		p, err := pgxpool.New(ctx, strings.TrimSpace(u))
		if err != nil {
			return fmt.Errorf("CAUGHTUP_REPLICA_URLS: %w", err)
		}
		defer p.Close()
		replicas = append(replicas, p)
	}
	if _, err := primary.Exec(ctx, `DROP TABLE IF EXISTS `+table+`; CREATE TABLE `+table+` (id bigserial PRIMARY KEY, body text NOT NULL)`); err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelError}))

	// One router per process, shared with the process's job workers if it
	// has any.
	router, err := consume.NewRouter(ctx, consume.Config{
		Databases: map[string]replay.Database{"main": {Primary: primary, Replicas: replay.Replicas(replicas...)}},
		Logger:    logger,
	})
	if err != nil {
		return err
	}
	defer router.Close()

	// In production the keys come from a secret store:
	// sign.ParseKeys(os.Getenv("SESSION_TOKEN_KEYS")).
	key, err := sign.GenerateKey("example")
	if err != nil {
		return err
	}
	mw, err := caughtuphttp.New(router, caughtuphttp.Config{
		Keys:     []sign.Key{key},
		Insecure: true, // plain HTTP on loopback; behind TLS keep the default, Secure
		Logger:   logger,
	})
	if err != nil {
		return err
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mw.Handler(app(primary)), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()

	st := &stats{reads: map[string]int{}}
	tr := &http.Transport{MaxIdleConnsPerHost: o.concurrency}
	defer tr.CloseIdleConnections()
	base := "http://" + ln.Addr().String()
	if err := browse(ctx, o, base, tr, st); err != nil {
		return err
	}
	fmt.Fprintln(stdout, st.summary(o))
	fmt.Fprintln(stderr, st.details())
	return nil
}

// need returns the environment variable name, or an error that names it.
func need(getenv func(string) string, name, what string) (string, error) {
	if v := strings.TrimSpace(getenv(name)); v != "" {
		return v, nil
	}
	return "", fmt.Errorf("%s is not set: it names %s (`make example EXAMPLE=web-session` starts the demo's cluster and sets it)", name, what)
}

// app is the application: a handler changes only where it gets its pool
// from. Writes go to the primary through enqueue, whose token the
// middleware puts in the cookie; reads come from consume.DB.
func app(primary *pgxpool.Pool) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /notes", func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(io.LimitReader(r.Body, 1<<10))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var id int64
		// COMMIT, then the insert position: the middleware's session
		// collects it, so the returned context is not needed here.
		if _, err := enqueue.InTx(r.Context(), primary, func(tx pgx.Tx) error {
			return tx.QueryRow(r.Context(), `INSERT INTO `+table+` (body) VALUES ($1) RETURNING id`, string(body)).Scan(&id)
		}); err != nil {
			var ce *enqueue.CaptureError
			if !errors.As(err, &ce) || !ce.Committed {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			// Committed without a token: the session's next requests
			// may read a replica without the note. Logged, not failed.
		}
		// Post/redirect/get: the redirect carries the cookie.
		http.Redirect(w, r, "/notes/"+strconv.FormatInt(id, 10), http.StatusSeeOther)
	})
	mux.HandleFunc("GET /notes/{id}", func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		var body string
		err := consume.DB(ctx, "main").QueryRow(ctx, `SELECT body FROM `+table+` WHERE id = $1`, r.PathValue("id")).Scan(&body)
		if errors.Is(err, pgx.ErrNoRows) {
			http.NotFound(w, r)
			return
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		d, _ := consume.DecisionFrom(ctx)
		from := "primary"
		if dd, ok := d.Database("main"); ok && dd.Replica != "" {
			from = "replica"
		}
		w.Header().Set("X-Read-From", from) // for the example's tally only
		fmt.Fprint(w, body)
	})
	return mux
}

// browse runs the sessions, o.concurrency at a time.
func browse(ctx context.Context, o options, base string, tr http.RoundTripper, st *stats) error {
	sessions := make(chan int)
	errs := make(chan error, o.concurrency)
	var wg sync.WaitGroup
	for range o.concurrency {
		wg.Go(func() {
			for n := range sessions {
				if err := session(ctx, o, base, tr, n, st); err != nil {
					errs <- fmt.Errorf("session %d: %w", n, err)
					return
				}
			}
		})
	}
	var err error
loop:
	for n := range o.sessions {
		select {
		case sessions <- n:
		case err = <-errs:
			break loop
		case <-ctx.Done():
			err = ctx.Err()
			break loop
		}
	}
	close(sessions)
	wg.Wait()
	close(errs)
	if err == nil {
		err = <-errs
	}
	return err
}

// session is one browser: it saves notes and reads each back through the
// redirect, then reads the first one again without its cookie, as another
// visitor would.
func session(ctx context.Context, o options, base string, tr http.RoundTripper, n int, st *stats) error {
	jar, err := cookiejar.New(nil)
	if err != nil {
		return err
	}
	browser := &http.Client{Transport: tr, Jar: jar}
	var first string
	for w := range o.writes {
		body := fmt.Sprintf("note %d of session %d", w, n)
		resp, err := retry(ctx, func() (*http.Request, error) {
			return http.NewRequestWithContext(ctx, http.MethodPost, base+"/notes", strings.NewReader(body))
		}, browser, st)
		if err != nil {
			return err
		}
		if w == 0 {
			first = resp.Request.URL.Path
		}
		st.read(resp, body)
	}
	visitor := &http.Client{Transport: tr}
	resp, err := retry(ctx, func() (*http.Request, error) {
		return http.NewRequestWithContext(ctx, http.MethodGet, base+first, nil)
	}, visitor, st)
	if err != nil {
		return err
	}
	st.anonymous(resp)
	return nil
}

type response struct {
	status int
	from   string
	body   string
	// Request is the last request of the redirect chain.
	Request *http.Request
}

// retry sends a request (following redirects), and sends it again after a
// short pause while the server answers 503, as a user pressing reload
// would.
func retry(ctx context.Context, req func() (*http.Request, error), c *http.Client, st *stats) (response, error) {
	for {
		r, err := req()
		if err != nil {
			return response{}, err
		}
		resp, err := c.Do(r)
		if err != nil {
			return response{}, err
		}
		b, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if err != nil {
			return response{}, err
		}
		if resp.StatusCode != http.StatusServiceUnavailable {
			return response{status: resp.StatusCode, from: resp.Header.Get("X-Read-From"), body: string(b), Request: resp.Request}, nil
		}
		st.unavailable()
		select {
		case <-time.After(100 * time.Millisecond):
		case <-ctx.Done():
			return response{}, ctx.Err()
		}
	}
}

// stats is what the sessions saw.
type stats struct {
	mu       sync.Mutex
	writes   int
	stale    int
	reads    map[string]int
	visitors map[string]int
	unavail  int
}

func (s *stats) read(r response, want string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.writes++
	if r.status != http.StatusOK || r.body != want {
		s.stale++
		return
	}
	s.reads[r.from]++
}

func (s *stats) anonymous(r response) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.visitors == nil {
		s.visitors = map[string]int{}
	}
	if r.status != http.StatusOK {
		// Another visitor has no token of the session's writes and may
		// read a replica that has not replayed the note yet: that is the
		// contract, not a stale read of its own writes.
		s.visitors["not yet"]++
		return
	}
	s.visitors[r.from]++
}

func (s *stats) unavailable() {
	s.mu.Lock()
	s.unavail++
	s.mu.Unlock()
}

// summary is the deterministic line: the same for every correct run.
func (s *stats) summary(o options) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return fmt.Sprintf("sessions=%d writes=%d stale=%d", o.sessions, s.writes, s.stale)
}

// details says where the reads went; it varies with timing.
func (s *stats) details() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return fmt.Sprintf("own writes read: replica=%d primary=%d; another visitor's reads: replica=%d primary=%d not_yet=%d; unavailable=%d",
		s.reads["replica"], s.reads["primary"], s.visitors["replica"], s.visitors["primary"], s.visitors["not yet"], s.unavail)
}
