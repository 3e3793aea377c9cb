package enqueue

import (
	"context"
	"fmt"
	"sync"

	"github.com/caughtup/caughtup/position"
)

// tokenKey's value is a position.Token, a TokenSource or a *lazyToken;
// tokenOf turns any of them into the token.
type tokenKey struct{}

type sessionKey struct{}

// session is a token shared by every context derived from one WithSession.
//
// A token source handed to the session (a routed handler's child token,
// or the lazy token WithSession started from) is kept as pending and
// merged in only when the session is next read or merged into, before
// anything else: the merges happen in the order they would have at once,
// so the token is the same, and a handler that never asks for it never
// computes it. The source is called with the session's lock held, once:
// it must not use the session it was handed to.
type session struct {
	mu  sync.Mutex
	tok position.Token
	// pending is a tokenKey value still to be merged into tok; with
	// base, it is the token WithSession started from, which tok takes as
	// it is.
	pending any
	base    bool
}

// resolve merges the pending source into tok; s.mu is held.
func (s *session) resolve() {
	if s.pending == nil {
		return
	}
	tok := tokenOf(s.pending)
	if s.base {
		s.tok = tok
	} else {
		s.tok = s.tok.Merge(tok)
	}
	s.pending, s.base = nil, false
}

func (s *session) merge(tok position.Token) {
	s.mu.Lock()
	s.resolve()
	s.tok = s.tok.Merge(tok)
	s.mu.Unlock()
}

// add hands the session src, to be merged when first needed.
func (s *session) add(src TokenSource) {
	s.mu.Lock()
	s.resolve()
	s.pending = src
	s.mu.Unlock()
}

func (s *session) token() position.Token {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.resolve()
	return s.tok
}

// sessionCtx is the context WithSession returns: its parent with the
// session, as context.WithValue(parent, sessionKey{}, &session) would
// give, in one allocation instead of two (the net/http middleware opens
// one per request).
type sessionCtx struct {
	context.Context
	session session
}

// Value answers sessionKey and leaves every other key to the parent.
func (c *sessionCtx) Value(key any) any {
	if _, ok := key.(sessionKey); ok {
		return &c.session
	}
	return c.Context.Value(key)
}

// String reads as context.WithValue's would.
func (c *sessionCtx) String() string {
	return contextName(c.Context) + ".WithValue(enqueue.sessionKey, *enqueue.session)"
}

// WithToken returns a context carrying tok merged (position.Token.Merge)
// with the token ctx already carries, so several writes and reads before
// one enqueue, in any order and on any databases, add up to one token that
// is satisfied only where all of them are. The stamping side of the queue
// adapters reads it with TokenFrom.
//
// Inside a WithSession context the merge goes into the session instead and
// ctx itself is returned.
func WithToken(ctx context.Context, tok position.Token) context.Context {
	if tok.IsZero() && tok.CapturedAt.IsZero() {
		return ctx
	}
	if s, ok := ctx.Value(sessionKey{}).(*session); ok {
		s.merge(tok)
		return ctx
	}
	prev := tokenOf(ctx.Value(tokenKey{}))
	return context.WithValue(ctx, tokenKey{}, prev.Merge(tok))
}

// A TokenSource supplies a token when it is first needed rather than when
// the context is made: consume.Router.Route gives every handler the job's
// token raised to what the replicas it reads had replayed, which only
// handlers that enqueue ever look at.
type TokenSource interface {
	// Token returns the token. It is called whenever the token is needed,
	// from any goroutine, and must return the same token every time.
	// A session (WithSession) calls it with its lock held: it must not
	// use the session it was handed to.
	Token() position.Token
}

// WithTokenSource is WithToken(ctx, src.Token()) with src.Token called
// only when the token is needed: by TokenFrom or WithToken on the
// returned context or one derived from it. The result is the same, since
// what ctx carries cannot change in between. Inside a WithSession
// context, where it can, src goes to the session, which merges its token
// before anything merged after it, when the session's token is next asked
// for or merged into; ctx itself is returned. A nil src adds nothing.
func WithTokenSource(ctx context.Context, src TokenSource) context.Context {
	if src == nil {
		return ctx
	}
	v := sourceValue(ctx, src)
	if v == nil {
		return ctx
	}
	return context.WithValue(ctx, tokenKey{}, v)
}

// sourceValue is the tokenKey value that carries src on top of ctx's
// token: src itself when there is nothing to merge it with, so that no
// allocation but the context's is needed. Inside a WithSession context it
// hands src to the session and returns nil: nothing is to be added to
// ctx.
func sourceValue(ctx context.Context, src TokenSource) any {
	if s, ok := ctx.Value(sessionKey{}).(*session); ok {
		s.add(src)
		return nil
	}
	if prev := ctx.Value(tokenKey{}); prev != nil {
		return &lazyToken{prev: prev, src: src}
	}
	return src
}

// SourceContext is WithTokenSource for a context type of one's own that
// embeds it: the type carries its own values and the token source in one
// allocation, where WithTokenSource would add a context of its own. It is
// for adapters that make a context per job at a high rate, as
// consume.Router.Route does for every Kafka message; most code calls
// WithTokenSource.
//
// Set it up with Init before use. Its Value answers TokenFrom as
// WithTokenSource(parent, src) would and leaves every other key to the
// parent; everything else is the parent's. A type that embeds it and
// answers keys of its own must pass the other keys to SourceContext.Value,
// not to the parent, or the token is lost.
type SourceContext struct {
	context.Context
	value any // tokenKey's value; nil: the parent's
}

// Init makes c the parent carrying src, as WithTokenSource(parent, src)
// would. Inside a WithSession context src goes to the session (as with
// WithTokenSource), and c carries nothing but the parent. A nil src adds
// nothing.
func (c *SourceContext) Init(parent context.Context, src TokenSource) {
	c.Context, c.value = parent, nil
	if src != nil {
		c.value = sourceValue(parent, src)
	}
}

// Value answers TokenFrom's key with the token source and leaves every
// other key to the parent.
func (c *SourceContext) Value(key any) any {
	if _, ok := key.(tokenKey); ok && c.value != nil {
		return c.value
	}
	return c.Context.Value(key)
}

// String reads as WithTokenSource's context would.
func (c *SourceContext) String() string {
	parent := contextName(c.Context)
	if c.value == nil {
		return parent
	}
	return fmt.Sprintf("%s.WithValue(enqueue.tokenKey, %T)", parent, c.value)
}

// contextName is how the context package names a parent context.
func contextName(ctx context.Context) string {
	if s, ok := ctx.(fmt.Stringer); ok {
		return s.String()
	}
	return fmt.Sprintf("%T", ctx)
}

// lazyToken is a TokenSource's token merged with the token of the
// context it was added to, computed once.
type lazyToken struct {
	prev any // a tokenKey value
	src  TokenSource
	once sync.Once
	tok  position.Token
}

func (l *lazyToken) token() position.Token {
	l.once.Do(func() { l.tok = tokenOf(l.prev).Merge(l.src.Token()) })
	return l.tok
}

// tokenOf returns the token a tokenKey value stands for.
func tokenOf(v any) position.Token {
	switch v := v.(type) {
	case position.Token:
		return v
	case *lazyToken:
		return v.token()
	case TokenSource:
		return v.Token()
	}
	return position.Token{}
}

// TokenFrom returns the token ctx carries and whether it has any entries.
func TokenFrom(ctx context.Context) (position.Token, bool) {
	var tok position.Token
	if s, ok := ctx.Value(sessionKey{}).(*session); ok {
		tok = s.token()
	} else {
		tok = tokenOf(ctx.Value(tokenKey{}))
	}
	return tok, !tok.IsZero()
}

// WithSession returns a context that collects tokens in one shared place:
// WithToken, and so Commit, InTx, AfterWrite and AfterReplicaRead, on it or
// on any context derived from it, merge into the session, and TokenFrom on
// any of them returns everything merged so far. Start one per request or
// job handler when code between the writes and the enqueue does not pass
// the returned context back up:
//
//	func handle(ctx context.Context, pool *pgxpool.Pool, client *caughtupasynq.Client) error {
//		ctx = enqueue.WithSession(ctx)
//		if err := createUser(ctx, pool); err != nil {
//			return err
//		}
//		task := caughtupasynq.NewTask(ctx, "email:welcome", nil)
//		_, err := client.EnqueueContext(ctx, task) // still stamped with createUser's position
//		return err
//	}
//
//	func createUser(ctx context.Context, pool *pgxpool.Pool) error {
//		_, err := enqueue.InTx(ctx, pool, func(tx pgx.Tx) error { // the returned ctx is dropped
//			_, err := tx.Exec(ctx, "INSERT INTO users DEFAULT VALUES")
//			return err
//		})
//		return err
//	}
//
// Without a session such a dropped context loses the write's position, and
// the job may run on a replica that has not replayed it. The session
// starts with the token ctx already carries (a token source's computed
// when first needed). Calling WithSession on a context that already has a
// session returns ctx unchanged. A session is safe for concurrent use.
func WithSession(ctx context.Context) context.Context {
	if _, ok := ctx.Value(sessionKey{}).(*session); ok {
		return ctx
	}
	c := &sessionCtx{Context: ctx}
	switch v := ctx.Value(tokenKey{}).(type) {
	case nil:
	case position.Token:
		c.session.tok = v
	default:
		c.session.pending, c.session.base = v, true
	}
	return c
}
