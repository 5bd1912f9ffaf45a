// The preference objectives on the device, so that a training step never waits for the host
// between the head's forward and its backward. Every objective reads the per-token logps only
// through three sums (chosen prompt, chosen response, rejected response), so its gradient is one
// constant per part. This is the CUDA form of the `*_sums` functions of train/objectives.rs,
// formula by formula in f64; the host later recomputes loss and metrics from the sums written here.

// Objective kinds (train::device_loss::Kind).
#define OBJ_SUMS 0
#define OBJ_ORPO_FULL 1
#define OBJ_ORPO_RESPONSE 2
#define OBJ_SFT_RESPONSE 3
#define OBJ_SFT_ALL 4
#define OBJ_DPO 5
#define OBJ_SIMPO 6

// objectives::LOGP_POSITIVE_TOLERANCE and ODDS_MEAN_CEILING.
#define OBJ_LOGP_TOL 1e-3
#define OBJ_ODDS_CEILING -1e-30

__device__ double obj_log_sigmoid(double x) {
    return x >= 0.0 ? -log1p(exp(-x)) : x - log1p(exp(x));
}

__device__ double obj_sigmoid(double x) {
    if (x >= 0.0) return 1.0 / (1.0 + exp(-x));
    const double e = exp(x);
    return e / (1.0 + e);
}

// log(1 - exp(x)) for x < 0 (Mächler's recipe), and its derivative -1 / expm1(-x).
__device__ double obj_log1mexp(double x) {
    return x > -0.6931471805599453 ? log(-expm1(x)) : log1p(-exp(x));
}

__device__ double obj_d_log1mexp(double x) { return -1.0 / expm1(-x); }

// d loss / d logp per part, from the part sums s and counts n (kinds as above).
__device__ void obj_coefficients(int kind, const double* s, const int* n, double p0, double p1,
                                 const double* ref, double* c) {
    c[0] = c[1] = c[2] = 0.0;
    switch (kind) {
    case OBJ_ORPO_FULL:
    case OBJ_ORPO_RESPONSE: {
        const double lambda = p0, nc = n[1], nr = n[2];
        const double lw = fmin(s[1] / nc, OBJ_ODDS_CEILING), lr = fmin(s[2] / nr, OBJ_ODDS_CEILING);
        const double log_odds = (lw - lr) - (obj_log1mexp(lw) - obj_log1mexp(lr));
        const double d_or = -obj_sigmoid(-log_odds);
        const double d_lw = lambda * d_or * (1.0 - obj_d_log1mexp(lw));
        const double d_lr = lambda * d_or * (-1.0 + obj_d_log1mexp(lr));
        double nll_prompt, nll_resp;
        if (kind == OBJ_ORPO_FULL) {
            const double all = (double)(n[0] + n[1]);
            nll_prompt = -1.0 / all;
            nll_resp = -1.0 / all;
        } else {
            nll_prompt = 0.0;
            nll_resp = -1.0 / nc;
        }
        c[0] = nll_prompt;
        c[1] = d_lw / nc + nll_resp;
        c[2] = d_lr / nr;
        break;
    }
    case OBJ_SFT_RESPONSE:
        c[1] = -1.0 / (double)n[1];
        break;
    case OBJ_SFT_ALL:
        c[0] = c[1] = -1.0 / (double)(n[0] + n[1]);
        break;
    case OBJ_DPO: {
        const double beta = p0, ls = p1;
        const double z = beta * ((s[1] - ref[1]) - (s[2] - ref[2]));
        const double dz = -(1.0 - ls) * obj_sigmoid(-z) + ls * obj_sigmoid(z);
        c[1] = beta * dz;
        c[2] = -beta * dz;
        break;
    }
    case OBJ_SIMPO: {
        const double beta = p0, gamma = p1;
        const double z = beta * (s[1] / n[1] - s[2] / n[2]) - gamma;
        const double dz = -obj_sigmoid(-z);
        c[1] = beta * dz / n[1];
        c[2] = -beta * dz / n[2];
        break;
    }
    default:
        break;
    }
}

// One block. Part p covers logp[start_p, start_p + len_p). stats: sums [0..3], first bad token
// (non-finite or above the tolerance; -1 if none) [3], its value [4], coefficients [5..8]. A bad
// token zeroes every coefficient; the host reports it when it reads the stats.
extern "C" __global__ void lf_obj_pair(const float* logp, int s0, int n0, int s1, int n1, int s2, int n2,
                                       int kind, double p0, double p1, const double* ref, float weight,
                                       double* stats, float* dlogp) {
    const int start[3] = {s0, s1, s2}, len[3] = {n0, n1, n2};
    __shared__ double red[3][32];
    __shared__ double coef[3];
    __shared__ int bad;
    if (threadIdx.x == 0) bad = 0x7fffffff;
    __syncthreads();
    double acc[3] = {0.0, 0.0, 0.0};
    #pragma unroll
    for (int p = 0; p < 3; ++p) {
        for (int i = threadIdx.x; i < len[p]; i += blockDim.x) {
            const double x = (double)logp[start[p] + i];
            if (!(isfinite(x) && x <= OBJ_LOGP_TOL)) atomicMin(&bad, start[p] + i);
            acc[p] += x;
        }
    }
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    #pragma unroll
    for (int p = 0; p < 3; ++p) {
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[p] += __shfl_xor_sync(0xffffffffu, acc[p], o);
        if (lane == 0) red[p][w] = acc[p];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double s[3];
        for (int p = 0; p < 3; ++p) {
            s[p] = 0.0;
            for (int k = 0; k < (int)(blockDim.x >> 5); ++k) s[p] += red[p][k];
            stats[p] = s[p];
        }
        double c[3] = {0.0, 0.0, 0.0};
        if (bad == 0x7fffffff) {
            obj_coefficients(kind, s, len, p0, p1, ref, c);
            stats[3] = -1.0;
            stats[4] = 0.0;
        } else {
            stats[3] = (double)bad;
            stats[4] = (double)logp[bad];
        }
        for (int p = 0; p < 3; ++p) {
            coef[p] = c[p];
            stats[5 + p] = c[p];
        }
    }
    __syncthreads();
    #pragma unroll
    for (int p = 0; p < 3; ++p) {
        const float g = (float)coef[p] * weight;
        for (int i = threadIdx.x; i < len[p]; i += blockDim.x) dlogp[start[p] + i] = g;
    }
}
