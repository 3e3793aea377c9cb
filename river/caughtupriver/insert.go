package caughtupriver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// MetadataKey is the key of a job's metadata (river.InsertOpts.Metadata, a
// JSON object) under which Insert and InsertMany put the token, as a JSON
// string in the header encoding (position.Token.Encode). It is the header
// name the other adapters use.
const MetadataKey = position.HeaderName

// ErrMetadataNotObject is returned by Insert and InsertMany for
// InsertOpts.Metadata that is not a JSON object, which River would store
// but no token can be added to.
var ErrMetadataNotObject = errors.New("caughtup/river: InsertOpts.Metadata must be a JSON object to carry a token")

// Insert is client.Insert with the token ctx carries (enqueue.TokenFrom)
// added to the job's metadata under MetadataKey, merged with a token the
// metadata already holds (position.MergeHeader). Use it for jobs inserted
// after the writes they depend on have committed: after enqueue.Commit or
// enqueue.InTx, or in a handler routed by the Middleware, whose context
// carries the job's token raised to what its replicas had replayed. A ctx
// without a token inserts the job as client.Insert does; the worker then
// routes it against the primary's position read after its fetch.
//
// Jobs inserted with client.InsertTx, inside the business transaction,
// need nothing: no token exists before the commit, and the position read
// after the fetch covers the transaction. There is deliberately no
// InsertTx here, and River's JobInsertMiddleware is not used: both run
// inside a transaction (River wraps Insert in one too), where a token in
// ctx from an earlier commit does not cover the writes of the transaction
// the job is inserted in, and a worker trusting it would read stale rows.
func Insert[TTx any](ctx context.Context, client *river.Client[TTx], args river.JobArgs, opts *river.InsertOpts) (*rivertype.JobInsertResult, error) {
	opts, err := stamp(ctx, opts)
	if err != nil {
		return nil, err
	}
	return client.Insert(ctx, args, opts)
}

// InsertMany is client.InsertMany with the token ctx carries added to
// every job's metadata, as Insert does.
func InsertMany[TTx any](ctx context.Context, client *river.Client[TTx], params []river.InsertManyParams) ([]*rivertype.JobInsertResult, error) {
	tok, ok := enqueue.TokenFrom(ctx)
	if ok {
		stamped := make([]river.InsertManyParams, len(params))
		for i, p := range params {
			o, err := stampToken(tok, p.InsertOpts)
			if err != nil {
				return nil, fmt.Errorf("caughtup/river: job %d of %d: %w", i, len(params), err)
			}
			stamped[i] = river.InsertManyParams{Args: p.Args, InsertOpts: o}
		}
		params = stamped
	}
	return client.InsertMany(ctx, params)
}

// stamp returns opts with ctx's token in its metadata; opts itself is not
// changed (callers share InsertOpts values).
func stamp(ctx context.Context, opts *river.InsertOpts) (*river.InsertOpts, error) {
	tok, ok := enqueue.TokenFrom(ctx)
	if !ok {
		return opts, nil
	}
	return stampToken(tok, opts)
}

func stampToken(tok position.Token, opts *river.InsertOpts) (*river.InsertOpts, error) {
	var o river.InsertOpts
	if opts != nil {
		o = *opts
	}
	md := map[string]json.RawMessage{}
	if len(o.Metadata) > 0 {
		if err := json.Unmarshal(o.Metadata, &md); err != nil || md == nil {
			return nil, ErrMetadataNotObject
		}
	}
	existing := ""
	if raw, ok := md[MetadataKey]; ok {
		if err := json.Unmarshal(raw, &existing); err != nil {
			// Not a string: unreadable, and unknown stays unknown (the
			// worker reads the primary), as MergeHeader keeps a header it
			// cannot decode.
			return &o, nil
		}
	}
	v, err := position.MergeHeader(existing, tok)
	if err != nil {
		return nil, fmt.Errorf("caughtup/river: stamping the job: %w", err)
	}
	enc, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	md[MetadataKey] = enc
	if o.Metadata, err = json.Marshal(md); err != nil {
		return nil, err
	}
	return &o, nil
}

// tokenMetadata is the part of a job's metadata TokenOf reads.
type metadataToken struct {
	Token json.RawMessage `json:"caughtup-token"`
}

// TokenOf returns the token in a job's metadata. ok is false when the
// metadata holds none (a job inserted with client.InsertTx, by a plain
// client, or without a token in its context). A token that is not a
// string, or does not decode, returns ok and the error (a
// *position.DecodeError for the latter): the Middleware then reads the
// primary. It never panics.
func TokenOf(job *rivertype.JobRow) (tok position.Token, ok bool, err error) {
	if job == nil || len(job.Metadata) == 0 {
		return position.Token{}, false, nil
	}
	var md metadataToken
	if err := json.Unmarshal(job.Metadata, &md); err != nil {
		// River writes metadata as a JSON object; something else wrote
		// this. Whether it held a token is unknown, which is malformed.
		return position.Token{}, true, fmt.Errorf("caughtup/river: job metadata is not a JSON object: %w", err)
	}
	if len(md.Token) == 0 || string(md.Token) == "null" {
		return position.Token{}, false, nil
	}
	var s string
	if err := json.Unmarshal(md.Token, &s); err != nil {
		return position.Token{}, true, fmt.Errorf("caughtup/river: metadata %q is not a string: %s", MetadataKey, excerpt(md.Token))
	}
	tok, err = position.DecodeHeaders(s)
	if err != nil {
		return position.Token{}, true, err
	}
	return tok, !tok.IsZero(), nil
}

// excerpt is at most 64 bytes of b, quoted, for an error message.
func excerpt(b []byte) string {
	const n = 64
	if len(b) > n {
		return fmt.Sprintf("%q…", b[:n])
	}
	return fmt.Sprintf("%q", b)
}
