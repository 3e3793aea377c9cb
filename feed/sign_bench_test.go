package feed

import "testing"

// The signature's cost per observation is the difference between the
// signed and the unsigned variants.

func BenchmarkEncode(b *testing.B) {
	for _, signed := range []bool{false, true} {
		b.Run(map[bool]string{false: "unsigned", true: "signed"}[signed], func(b *testing.B) {
			k := testKey("k1")
			macs := newMACs("default", []Key{k})
			m := sampleMessage("", sampleReplica())
			if signed {
				m.keyID = k.ID
			}
			buf := make([]byte, 0, 256)
			b.ReportAllocs()
			for b.Loop() {
				out, err := appendMessage(buf[:0], &m)
				if err != nil {
					b.Fatal(err)
				}
				if signed {
					out = append(out, macs.Sum(m.keyID, out)...)
				}
				buf = out
			}
			b.ReportMetric(float64(len(buf)), "bytes/msg")
		})
	}
}

func BenchmarkVerify(b *testing.B) {
	for _, signed := range []bool{false, true} {
		b.Run(map[bool]string{false: "unsigned", true: "signed"}[signed], func(b *testing.B) {
			k := testKey("k1")
			macs := newMACs("default", []Key{k})
			key := &k
			if !signed {
				key = nil
			}
			msg := encodeSigned(b, "default", key, sampleMessage("", sampleReplica()))
			b.ReportAllocs()
			for b.Loop() {
				m, err := parseMessage(msg)
				if err != nil {
					b.Fatal(err)
				}
				if signed {
					if ok, _ := macs.Verify(m.keyID, m.signed, m.mac); !ok {
						b.Fatal("does not verify")
					}
				}
			}
		})
	}
}
