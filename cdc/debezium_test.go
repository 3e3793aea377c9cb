package cdc

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/caughtup/caughtup/position"
)

// A change event as Debezium 2.x's PostgreSQL connector writes it with the
// JSON converter and schemas enabled (schema shortened).
const wrappedEnvelope = `{
  "schema": {"type": "struct", "name": "srv.public.orders.Envelope"},
  "payload": {
    "before": null,
    "after": {"id": 42, "note": "n"},
    "source": {
      "version": "2.5.0.Final", "connector": "postgresql", "name": "srv",
      "ts_ms": 1700000000000, "snapshot": "false", "db": "app",
      "sequence": "[\"24023128\",\"24023184\"]", "schema": "public", "table": "orders",
      "txId": 747, "lsn": 24023184, "xmin": null
    },
    "op": "c", "ts_ms": 1700000000123, "transaction": null
  }
}`

const bareEnvelope = `{"before":null,"after":{"id":1},"source":{"version":"1.9.7.Final","connector":"postgresql","name":"srv","ts_ms":1,"snapshot":false,"db":"app","schema":"public","table":"orders","txId":4294967295,"lsn":"16/B374D848","xmin":12},"op":"u","ts_ms":2}`

func TestParseDebezium(t *testing.T) {
	t.Parallel()
	ev, err := ParseDebezium([]byte(wrappedEnvelope))
	require.NoError(t, err)
	require.NoError(t, ev.Validate())
	assert.Equal(t, "c", ev.Op)
	assert.Equal(t, int64(1700000000123), ev.TsMs)
	assert.JSONEq(t, `{"id": 42, "note": "n"}`, string(ev.After))
	assert.Equal(t, Source{
		Version: "2.5.0.Final", Connector: "postgresql", Name: "srv", TsMs: 1700000000000, Snapshot: "false",
		DB: "app", Schema: "public", Table: "orders", TxID: 747, LSN: 24023184,
		Sequence: `["24023128","24023184"]`,
	}, ev.Source)

	ev, err = ParseDebezium([]byte(bareEnvelope))
	require.NoError(t, err)
	require.NoError(t, ev.Validate())
	assert.Equal(t, position.MustParseLSN("16/B374D848"), ev.Source.LSN)
	assert.Equal(t, uint64(4294967295), ev.Source.TxID)
	assert.Equal(t, uint64(12), ev.Source.Xmin)
	assert.Equal(t, "false", ev.Source.Snapshot)

	// An LSN above 2^53 must survive exactly (float64 would round it).
	ev, err = ParseDebezium([]byte(`{"source":{"connector":"postgresql","lsn":18446744073709551615,"txId":"9"},"op":"c"}`))
	require.NoError(t, err)
	assert.Equal(t, position.LSN(1<<64-1), ev.Source.LSN)
	assert.Equal(t, uint64(9), ev.Source.TxID)
}

func TestDebeziumEnvelopesWithoutASafeRule(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, in string
		reason   Reason
	}{
		{"not json", `not json`, ReasonMalformed},
		{"empty", ``, ReasonMalformed},
		{"array", `[1,2]`, ReasonMalformed},
		{"string", `"x"`, ReasonMalformed},
		{"no source", `{"op":"c","after":{}}`, ReasonMalformed},
		{"null payload", `{"schema":{},"payload":null}`, ReasonMalformed},
		{"payload not object", `{"payload":5}`, ReasonMalformed},
		{"source not object", `{"source":"x"}`, ReasonMalformed},
		{"negative lsn", `{"source":{"connector":"postgresql","lsn":-1,"txId":5}}`, ReasonMalformed},
		{"fractional lsn", `{"source":{"connector":"postgresql","lsn":1.5,"txId":5}}`, ReasonMalformed},
		{"lsn as object", `{"source":{"connector":"postgresql","lsn":{},"txId":5}}`, ReasonMalformed},
		{"bad lsn text", `{"source":{"connector":"postgresql","lsn":"1/XYZ","txId":5}}`, ReasonMalformed},
		{"txId overflow", `{"source":{"connector":"postgresql","lsn":5,"txId":18446744073709551616}}`, ReasonMalformed},
		{"truncated", wrappedEnvelope[:200], ReasonMalformed},
		{"mysql", `{"source":{"connector":"mysql","file":"binlog.000003","pos":154,"txId":5,"lsn":5}}`, ReasonNotPostgreSQL},
		{"no connector", `{"source":{"lsn":5,"txId":5}}`, ReasonNotPostgreSQL},
		{"missing lsn", `{"source":{"connector":"postgresql","txId":5}}`, ReasonMissingLSN},
		{"null lsn", `{"source":{"connector":"postgresql","lsn":null,"txId":5}}`, ReasonMissingLSN},
		{"zero lsn", `{"source":{"connector":"postgresql","lsn":0,"txId":5}}`, ReasonMissingLSN},
		{"missing txId", `{"source":{"connector":"postgresql","lsn":5}}`, ReasonMissingTxID},
		{"snapshot read", `{"op":"r","source":{"connector":"postgresql","lsn":5,"txId":5,"snapshot":"true"}}`, ReasonSnapshot},
		{"snapshot last", `{"op":"c","source":{"connector":"postgresql","lsn":5,"txId":5,"snapshot":"last"}}`, ReasonSnapshot},
		{"snapshot bool", `{"op":"c","source":{"connector":"postgresql","lsn":5,"txId":5,"snapshot":true}}`, ReasonSnapshot},
		{"op r without flag", `{"op":"r","source":{"connector":"postgresql","lsn":5,"txId":5}}`, ReasonSnapshot},
	}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	checker, err := NewChecker(Config{MeterProvider: mp})
	require.NoError(t, err)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ev, perr := ParseDebezium([]byte(tt.in))
			if perr == nil {
				perr = ev.Validate()
			}
			var cerr *EnvelopeError
			require.ErrorAs(t, perr, &cerr)
			require.Equal(t, tt.reason, cerr.Reason, "%v", perr)
			if tt.reason == ReasonMalformed {
				require.ErrorIs(t, perr, ErrMalformedEnvelope)
			} else {
				require.ErrorIs(t, perr, ErrNoCommitSafeRule)
			}
			require.Contains(t, perr.Error(), "read the primary")
			// The checker never touches the replica for these.
			_, res := checker.CheckEnvelope(context.Background(), nil, []byte(tt.in))
			require.Equal(t, StatusUnknown, res.Status)
			require.Equal(t, tt.reason, res.Reason)
			require.True(t, errors.Is(res.Err, ErrMalformedEnvelope) || errors.Is(res.Err, ErrNoCommitSafeRule))
		})
	}
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	counts := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		require.Equal(t, ScopeName, sm.Scope.Name)
		for _, m := range sm.Metrics {
			if m.Name != "caughtup.cdc.primary" {
				continue
			}
			require.Equal(t, "{event}", m.Unit)
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				r, _ := dp.Attributes.Value("caughtup.reason")
				counts[r.AsString()] += dp.Value
			}
		}
	}
	want := map[string]int64{}
	for _, tt := range tests {
		want[tt.reason.String()]++
	}
	require.Equal(t, want, counts)
}

func TestWidenXID(t *testing.T) {
	t.Parallel()
	const epoch = uint64(5) << 32
	tests := []struct {
		name      string
		txid, ref uint64
		want      uint64
		ok        bool
	}{
		{"same epoch, below horizon", 1000, epoch | 2000, epoch | 1000, true},
		{"same epoch, at horizon", 2000, epoch | 2000, epoch | 2000, true},
		{"same epoch, slightly ahead", 2500, epoch | 2000, epoch | 2500, true},
		// The horizon wrapped, the event's xid is from before the wrap.
		{"previous epoch", 0xFFFFFF00, epoch | 0x10, (epoch - 1<<32) | 0xFFFFFF00, true},
		// The event's xid wrapped, the standby's horizon has not: the
		// "epoch-1 if larger" rule would put it 4 billion xids back.
		{"next epoch, standby behind", 0x10, epoch | 0xFFFFFF00, (epoch + 1<<32) | 0x10, true},
		{"epoch zero", 731, 800, 731, true},
		{"epoch zero, would underflow", 0xFFFFFFF0, 800, 0, false},
		{"special xids", 2, 800, 0, false},
		{"zero", 0, 800, 0, false},
		{"already 64-bit", epoch | 7, 800, epoch | 7, true},
	}
	for _, tt := range tests {
		got, ok := WidenXID(tt.txid, tt.ref)
		assert.Equal(t, tt.ok, ok, tt.name)
		assert.Equal(t, tt.want, got, tt.name)
	}
}

func FuzzParseDebezium(f *testing.F) {
	for _, s := range []string{wrappedEnvelope, bareEnvelope, `{}`, `{"payload":{}}`, `{"source":{"lsn":"0/0"}}`, `null`, `{"source":{"connector":"postgresql","lsn":1e3,"txId":"-1"}}`} {
		f.Add([]byte(s))
	}
	checker, err := NewChecker(Config{})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		ev, err := ParseDebezium(data)
		if err != nil {
			var cerr *EnvelopeError
			if !errors.As(err, &cerr) || cerr.Reason != ReasonMalformed || !strings.Contains(err.Error(), "read the primary") {
				t.Fatalf("ParseDebezium error %v is not a malformed *EnvelopeError", err)
			}
			return
		}
		if verr := ev.Validate(); verr != nil {
			var cerr *EnvelopeError
			if !errors.As(verr, &cerr) || cerr.Reason == ReasonNone {
				t.Fatalf("Validate error %v has no reason", verr)
			}
			// Unsafe envelopes never reach a replica (nil would panic).
			_, res := checker.CheckEnvelope(context.Background(), nil, data)
			if res.Status != StatusUnknown || res.Reason != cerr.Reason {
				t.Fatalf("CheckEnvelope = %+v, want unknown/%v", res, cerr.Reason)
			}
			return
		}
		if ev.Source.LSN == 0 || ev.Source.TxID == 0 || !strings.EqualFold(ev.Source.Connector, "postgresql") {
			t.Fatalf("Validate accepted %+v", ev.Source)
		}
	})
}
