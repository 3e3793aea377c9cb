package caughtupriver

import (
	"encoding/json"
	"reflect"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
)

func tokenAt(lsn position.LSN) position.Token {
	return position.New("main", position.Epoch{SystemID: 42, Timeline: 1}, lsn, position.SourcePrimary, time.UnixMilli(1_700_000_000_000))
}

// The struct tag TokenOf reads is MetadataKey.
func TestMetadataKeyIsTheTag(t *testing.T) {
	f, _ := reflect.TypeFor[metadataToken]().FieldByName("Token")
	require.Equal(t, MetadataKey, f.Tag.Get("json"))
}

func TestStampMergesIntoMetadata(t *testing.T) {
	// The caller's keys are kept, and a token already there is merged.
	first, err := stampToken(tokenAt(100), &river.InsertOpts{Metadata: []byte(`{"app":1}`)})
	require.NoError(t, err)
	opts, err := stampToken(tokenAt(50), first)
	require.NoError(t, err)
	tok, ok, err := TokenOf(&rivertype.JobRow{Metadata: opts.Metadata})
	require.NoError(t, err)
	require.True(t, ok)
	e, _ := tok.Entry("main")
	require.Equal(t, position.LSN(100), e.LSN, "the furthest position is kept")
	var md map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(opts.Metadata, &md))
	require.JSONEq(t, `1`, string(md["app"]))

	// Not an object: refused rather than dropped.
	for _, bad := range []string{`[1]`, `"x"`, `null`, `{`} {
		_, err = stampToken(tokenAt(1), &river.InsertOpts{Metadata: []byte(bad)})
		require.ErrorIs(t, err, ErrMetadataNotObject, bad)
	}

	// A token value that is not a string stays: unknown stays unknown.
	opts, err = stampToken(tokenAt(1), &river.InsertOpts{Metadata: []byte(`{"caughtup-token":5}`)})
	require.NoError(t, err)
	_, ok, err = TokenOf(&rivertype.JobRow{Metadata: opts.Metadata})
	require.True(t, ok)
	require.Error(t, err)

	// One that does not decode stays too (position.MergeHeader's rule).
	opts, err = stampToken(tokenAt(1), &river.InsertOpts{Metadata: []byte(`{"caughtup-token":"v9;zz"}`)})
	require.NoError(t, err)
	_, _, err = TokenOf(&rivertype.JobRow{Metadata: opts.Metadata})
	var de *position.DecodeError
	require.ErrorAs(t, err, &de)
}

func TestTokenOfNeverPanics(t *testing.T) {
	for _, md := range []string{``, `{}`, `{"caughtup-token":null}`, `{"caughtup-token":""}`, `not json`, `{"caughtup-token":{"a":1}}`, `{"caughtup-token":"\u0000"}`} {
		require.NotPanics(t, func() { _, _, _ = TokenOf(&rivertype.JobRow{Metadata: []byte(md)}) }, md)
	}
	_, ok, err := TokenOf(nil)
	require.False(t, ok)
	require.NoError(t, err)
}
