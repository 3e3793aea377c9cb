package feed

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/sign"
)

var (
	testEpoch = position.Epoch{SystemID: 7412345678901234567, Timeline: 3}
	testTime  = time.Date(2025, 6, 1, 12, 30, 45, 123456000, time.UTC)
)

func testKey(id string) Key {
	return Key{ID: id, Secret: bytes.Repeat([]byte(id[:1]), MinSecretLen)}
}

func samplePrimary() Observation {
	return Observation{
		Database: "main", Node: "pg-0", Role: RolePrimary,
		Primary: PrimaryStatus{
			Epoch: testEpoch, InsertLSN: position.MustParseLSN("16/B374D848"),
			History:      position.History{{Timeline: 1, Switchpoint: 0x3000060}, {Timeline: 2, Switchpoint: 0x16B0000000}},
			HistoryKnown: true,
			WAL:          position.WALLayout{MaxAlign: 8, BlockSize: 8192, SegmentSize: 16 << 20},
		},
	}
}

func sampleReplica() Observation {
	return Observation{
		Database: "main", Node: "replica-1", Role: RoleReplica,
		Replica: ReplicaStatus{
			InRecovery: true, Replayed: position.MustParseLSN("16/B374D000"), Epoch: testEpoch,
			ReplayTimestamp: testTime, TimeLag: 1500 * time.Microsecond, Incarnation: testTime.Add(-time.Hour),
			RecoveryStart: testTime.Add(-time.Minute),
		},
	}
}

func sampleMessage(keyID string, o Observation) message {
	return message{keyID: keyID, publisher: "feed-a", instance: 0xdeadbeefcafe, seq: 42,
		sentAt: testTime, ttl: 10 * time.Second, held: 2345 * time.Microsecond, obs: o}
}

// encodeSigned is what a Publisher sends.
func encodeSigned(t testing.TB, feed string, key *Key, m message) []byte {
	t.Helper()
	if key != nil {
		m.keyID = key.ID
	}
	b, err := appendMessage(nil, &m)
	require.NoError(t, err)
	if key != nil {
		b = append(b, newMACs(feed, []Key{*key}).Sum(key.ID, b)...)
	}
	return b
}

func TestMessageRoundTrip(t *testing.T) {
	t.Parallel()
	k := testKey("k1")
	errObs := sampleReplica()
	errObs.Err = "connection refused"
	unknownHist := samplePrimary()
	unknownHist.Primary.HistoryKnown, unknownHist.Primary.History = false, nil
	nullReplica := Observation{Database: "main", Node: "r", Role: RoleReplica}
	for name, o := range map[string]Observation{
		"primary": samplePrimary(), "replica": sampleReplica(), "error": errObs,
		"history unknown": unknownHist, "replica nulls": nullReplica,
	} {
		for _, signed := range []bool{true, false} {
			key := &k
			if !signed {
				key = nil
			}
			b := encodeSigned(t, "default", key, sampleMessage("", o))
			m, err := parseMessage(b)
			require.NoError(t, err, name)
			want := o
			if want.Err != "" {
				want.Primary, want.Replica = PrimaryStatus{}, ReplicaStatus{} // not sent
			}
			require.Equal(t, want, m.obs, name)
			require.Equal(t, "feed-a", m.publisher)
			require.Equal(t, uint64(0xdeadbeefcafe), m.instance)
			require.Equal(t, uint64(42), m.seq)
			require.True(t, testTime.Equal(m.sentAt))
			require.Equal(t, 10*time.Second, m.ttl)
			require.Equal(t, 2345*time.Microsecond, m.held)
			if signed {
				require.Equal(t, "k1", m.keyID)
				ok, known := newMACs("default", []Key{k}).Verify(m.keyID, m.signed, m.mac)
				require.True(t, known)
				require.True(t, ok, "%s: signature verifies", name)
			} else {
				require.Empty(t, m.keyID)
				require.Nil(t, m.mac)
			}
			require.LessOrEqual(t, len(b), 200, "%s: compact", name)
		}
	}
}

func TestErrTextIsCut(t *testing.T) {
	t.Parallel()
	o := sampleReplica()
	o.Err = strings.Repeat("é", MaxErrLen) + "\xff"
	m, err := parseMessage(encodeSigned(t, "f", nil, sampleMessage("", o)))
	require.NoError(t, err)
	require.LessOrEqual(t, len(m.obs.Err), MaxErrLen)
	require.True(t, strings.HasPrefix(o.Err, m.obs.Err))
	require.Equal(t, ReplicaStatus{}, m.obs.Replica, "no values after an error")
}

func TestEncodeRefuses(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("x", MaxNameLen+1)
	hist := samplePrimary()
	hist.Primary.History = make(position.History, MaxHistory+1)
	for name, o := range map[string]Observation{
		"no database":   {Node: "r", Role: RoleReplica},
		"no role":       {Database: "main", Node: "r"},
		"role 3":        {Database: "main", Node: "r", Role: 3},
		"replica name":  {Database: "main", Role: RoleReplica},
		"long name":     {Database: long, Node: "r", Role: RoleReplica},
		"control char":  {Database: "ma\nin", Node: "r", Role: RoleReplica},
		"long history":  hist,
		"invalid UTF-8": {Database: "main", Node: "\xff", Role: RoleReplica},
	} {
		m := sampleMessage("", o)
		_, err := appendMessage(nil, &m)
		require.Error(t, err, name)
	}
	// The longest acceptable observation fits MaxMessageSize.
	o := samplePrimary()
	o.Database, o.Node = strings.Repeat("d", MaxNameLen), strings.Repeat("n", MaxNameLen)
	o.Primary.History = make(position.History, MaxHistory)
	for i := range o.Primary.History {
		o.Primary.History[i] = position.TimelineSwitch{Timeline: 1<<32 - 1, Switchpoint: 1<<64 - 1}
	}
	m := sampleMessage(strings.Repeat("k", MaxKeyIDLen), o)
	m.publisher, m.seq = strings.Repeat("p", MaxNameLen), 1<<64-1
	b, err := appendMessage(nil, &m)
	require.NoError(t, err)
	require.LessOrEqual(t, len(b)+macSize, MaxMessageSize)
}

func TestParseIsStrict(t *testing.T) {
	t.Parallel()
	k := testKey("k1")
	good := encodeSigned(t, "f", &k, sampleMessage("", sampleReplica()))
	_, err := parseMessage(good)
	require.NoError(t, err)

	for n := range len(good) {
		_, err := parseMessage(good[:n])
		require.ErrorIs(t, err, ErrMalformed, "truncated to %d bytes", n)
	}
	_, err = parseMessage(append(bytes.Clone(good), 0))
	require.ErrorIs(t, err, ErrMalformed, "trailing byte")

	v2 := bytes.Clone(good)
	v2[0] = 2
	_, err = parseMessage(v2)
	require.ErrorIs(t, err, ErrUnsupportedVersion)
	var fe *FormatError
	require.ErrorAs(t, err, &fe)

	_, err = parseMessage(make([]byte, MaxMessageSize+1))
	require.ErrorIs(t, err, ErrMalformed, "oversized")

	// Layout of sampleMessage("k1", replica): version, key ID, publisher,
	// instance, then the sequence (42: one byte).
	seqAt := 1 + 1 + 2 + 1 + len("feed-a") + 8
	require.Equal(t, byte(42), good[seqAt])
	nonMinimal := append(append(bytes.Clone(good[:seqAt]), 42|0x80, 0), good[seqAt+1:]...)
	_, err = parseMessage(nonMinimal)
	require.ErrorIs(t, err, ErrMalformed, "non-minimal varint")
	require.ErrorAs(t, err, &fe)
	require.Contains(t, fe.What, "minimal")

	zeroSeq := bytes.Clone(good)
	zeroSeq[seqAt] = 0
	_, err = parseMessage(zeroSeq)
	require.ErrorIs(t, err, ErrMalformed, "sequence 0")

	badKeyID := bytes.Clone(good)
	badKeyID[2] = '{'
	_, err = parseMessage(badKeyID)
	require.ErrorIs(t, err, ErrMalformed, "key ID charset")

	// Unknown flag bits, an unknown role, a nameless replica, history
	// entries while unknown.
	for name, mutate := range map[string]func(o *Observation) []byte{
		"replica flags": func(o *Observation) []byte {
			b := encodeSigned(t, "f", nil, sampleMessage("", *o))
			i := bytes.Index(b, []byte("replica-1")) + len("replica-1") + 1 + 1 // role, error length
			require.Equal(t, byte(flagInRecovery|flagReplayTS|flagIncarnation|flagRecoveryStart), b[i])
			b[i] |= 1 << 5
			return b
		},
		"recovery start without incarnation": func(o *Observation) []byte {
			o.Replica.Incarnation = time.Time{}
			b := encodeSigned(t, "f", nil, sampleMessage("", *o))
			i := bytes.Index(b, []byte("replica-1")) + len("replica-1") + 1 + 1
			require.Equal(t, byte(flagInRecovery|flagReplayTS), b[i])
			b[i] |= flagRecoveryStart
			return append(b, 0x02) // a recovery start to read
		},
		"role": func(o *Observation) []byte {
			b := encodeSigned(t, "f", nil, sampleMessage("", *o))
			i := bytes.Index(b, []byte("replica-1")) + len("replica-1")
			b[i] = 3
			return b
		},
		"primary history while unknown": func(o *Observation) []byte {
			p := samplePrimary()
			b := encodeSigned(t, "f", nil, sampleMessage("", p))
			i := bytes.Index(b, []byte("pg-0")) + len("pg-0") + 1 + 1
			require.Equal(t, byte(flagHistoryKnown), b[i])
			b[i] = 0
			return b
		},
	} {
		o := sampleReplica()
		_, err := parseMessage(mutate(&o))
		require.ErrorIs(t, err, ErrMalformed, name)
	}
}

// TestSignatureCoversEverything flips every bit of a signed message: it
// either no longer parses or no longer verifies.
func TestSignatureCoversEverything(t *testing.T) {
	t.Parallel()
	k := testKey("k1")
	macs := newMACs("f", []Key{k})
	good := encodeSigned(t, "f", &k, sampleMessage("", samplePrimary()))
	for i := range good {
		for bit := range 8 {
			b := bytes.Clone(good)
			b[i] ^= 1 << bit
			m, err := parseMessage(b)
			if err != nil {
				continue
			}
			ok, known := macs.Verify(m.keyID, m.signed, m.mac)
			require.False(t, ok && known, "byte %d bit %d flipped and still verifies", i, bit)
		}
	}
	// Another feed with the same key does not verify it.
	m, err := parseMessage(good)
	require.NoError(t, err)
	ok, known := newMACs("other", []Key{k}).Verify(m.keyID, m.signed, m.mac)
	require.True(t, known)
	require.False(t, ok, "a message of feed f verifies on feed other")
}

// FuzzParseMessage checks that parsing never panics, that every rejection
// is a *FormatError, and that whatever parses has exactly one encoding:
// re-encoding it gives back the same bytes.
func FuzzParseMessage(f *testing.F) {
	k := testKey("k1")
	errObs := sampleReplica()
	errObs.Err = "FATAL: the database system is starting up"
	for _, o := range []Observation{samplePrimary(), sampleReplica(), errObs, {Database: "d", Node: "n", Role: RoleReplica}} {
		f.Add(encodeSigned(f, "f", &k, sampleMessage("", o)))
		f.Add(encodeSigned(f, "f", nil, sampleMessage("", o)))
	}
	f.Add([]byte{})
	f.Add([]byte{1})
	f.Add([]byte{2, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := parseMessage(b)
		if err != nil {
			var fe *FormatError
			if !errors.As(err, &fe) || (!errors.Is(err, ErrMalformed) && !errors.Is(err, ErrUnsupportedVersion)) {
				t.Fatalf("parseMessage error %v is not a *FormatError", err)
			}
			return
		}
		if len(b) > MaxMessageSize {
			t.Fatalf("accepted %d bytes", len(b))
		}
		again, err := appendMessage(nil, &m)
		if err != nil {
			t.Fatalf("accepted a message that does not encode: %v", err)
		}
		again = append(again, m.mac...)
		if !bytes.Equal(again, b) {
			t.Fatalf("two encodings of one message:\n%x\n%x", b, again)
		}
	})
}

// TestKeys: the feed's keys are package sign's (tested there); feed's
// names for them report what is wrong as configuration errors.
func TestKeys(t *testing.T) {
	t.Parallel()
	a, err := GenerateKey("2025-06")
	require.NoError(t, err)
	keys, err := ParseKeys(a.Export())
	require.NoError(t, err)
	require.Equal(t, []Key{a}, keys)
	for _, bad := range []string{"nocolon", "k:!!!", "k:" + "c2hvcnQ="} {
		_, err := ParseKeys(bad)
		require.ErrorIs(t, err, ErrInvalidConfig, bad)
		require.ErrorIs(t, err, sign.ErrInvalidKey, bad)
	}
	_, err = GenerateKey("a b")
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.ErrorIs(t, checkKeys(Keyring{Keys: []Key{a, a}}), ErrInvalidConfig, "duplicate ID")
	require.ErrorIs(t, checkKeys(Keyring{Keys: []Key{a}, Current: "nope"}), ErrInvalidConfig, "unknown Current")
	require.NoError(t, checkKeys(Keyring{Keys: []Key{a}}))
}

func TestValueKeysAreDistinct(t *testing.T) {
	t.Parallel()
	a := Observation{Database: "a:b", Node: "c", Role: RoleReplica}
	b := Observation{Database: "a", Node: "b:c", Role: RoleReplica}
	require.NotEqual(t, valueKey("f", "p", &a), valueKey("f", "p", &b))
	require.True(t, strings.HasPrefix(valueKey("f", "p", &a), "{caughtup.feed.f}:latest:"))
}
