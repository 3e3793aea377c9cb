package enqueue

import (
	"context"
	"sync"

	"github.com/caughtup/caughtup/position"
)

type tokenKey struct{}

type sessionKey struct{}

// session is a token shared by every context derived from one WithSession.
type session struct {
	mu  sync.Mutex
	tok position.Token
}

func (s *session) merge(tok position.Token) {
	s.mu.Lock()
	s.tok = s.tok.Merge(tok)
	s.mu.Unlock()
}

func (s *session) token() position.Token {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.tok
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
	prev, _ := ctx.Value(tokenKey{}).(position.Token)
	return context.WithValue(ctx, tokenKey{}, prev.Merge(tok))
}

// TokenFrom returns the token ctx carries and whether it has any entries.
func TokenFrom(ctx context.Context) (position.Token, bool) {
	var tok position.Token
	if s, ok := ctx.Value(sessionKey{}).(*session); ok {
		tok = s.token()
	} else {
		tok, _ = ctx.Value(tokenKey{}).(position.Token)
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
//	ctx = enqueue.WithSession(ctx)
//	_ = createUser(ctx, pool) // calls enqueue.InTx and drops the returned ctx
//	enqueueWelcomeMail(ctx)   // still stamped with createUser's position
//
// Without a session such a dropped context loses the write's position, and
// the job may run on a replica that has not replayed it. The session
// starts with the token ctx already carries. Calling WithSession on a
// context that already has a session returns ctx unchanged. A session is
// safe for concurrent use.
func WithSession(ctx context.Context) context.Context {
	if _, ok := ctx.Value(sessionKey{}).(*session); ok {
		return ctx
	}
	s := &session{}
	s.tok, _ = ctx.Value(tokenKey{}).(position.Token)
	return context.WithValue(ctx, sessionKey{}, s)
}
